"""A small fake paged KV cache and an AttentionMetadata builder for tests.

The cache hands out blocks in a shuffled order, so requests get non-contiguous blocks, and
starts filled with NaN, so reading a slot that was never written poisons the output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata


class FakeKVCacheManager:
    """`get_buffers(layer_idx) -> [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]`."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        tokens_per_block: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.tokens_per_block = tokens_per_block
        shape = (num_blocks, 2, tokens_per_block, num_kv_heads, head_dim)
        self.buffers = [
            torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(num_layers)
        ]
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks: list[int] = torch.randperm(num_blocks, generator=gen).tolist()
        self.blocks: dict[int, list[int]] = {}

    def get_buffers(self, layer_idx: int) -> torch.Tensor:
        return self.buffers[layer_idx]

    def reserve(self, request_id: int, num_tokens: int) -> list[int]:
        """Make sure `request_id` has blocks for `num_tokens` tokens; return its block list."""
        blocks = self.blocks.setdefault(request_id, [])
        while len(blocks) * self.tokens_per_block < num_tokens:
            if not self.free_blocks:
                raise ValueError("fake KV cache is out of blocks")
            blocks.append(self.free_blocks.pop())
        return blocks


def build_metadata(
    manager: FakeKVCacheManager | None,
    context: Sequence[tuple[int, int, int]] = (),
    generation: Sequence[tuple[int, int]] = (),
    pad_to: int | None = None,
    device: str | torch.device = "cpu",
) -> AttentionMetadata:
    """Metadata for one step.

    `context`: `(request_id, num_new_tokens, num_cached_tokens)` per context request (chunks);
    `generation`: `(request_id, num_cached_tokens)` per generation request (one new token).
    `pad_to` pads `slot_mapping` with -1 up to that many tokens.
    """
    reqs = [(r, n, c) for r, n, c in context] + [(r, 1, c) for r, c in generation]
    seq_lens = torch.tensor([n for _, n, _ in reqs], dtype=torch.int32)
    cached = torch.tensor([c for _, _, c in reqs], dtype=torch.int32)
    num_tokens = int(seq_lens.sum())
    cu = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    slots: list[int] = []
    tables: list[list[int]] = []
    tokens_per_block = manager.tokens_per_block if manager is not None else 1
    for rid, n, c in reqs:
        if manager is None:
            tables.append([])
            slots.extend([-1] * n)
            continue
        blocks = manager.reserve(rid, c + n)
        tables.append(blocks)
        for pos in range(c, c + n):
            slots.append(
                blocks[pos // tokens_per_block] * tokens_per_block + pos % tokens_per_block
            )
    width = max([len(t) for t in tables] + [1])
    block_tables = torch.full((len(reqs), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    padded = max(pad_to or 0, num_tokens)
    slot_mapping = torch.full((padded,), -1, dtype=torch.int64)
    slot_mapping[:num_tokens] = torch.tensor(slots, dtype=torch.int64)
    seq_slots = torch.tensor([r for r, _, _ in reqs], dtype=torch.int64)
    num_ctx_tokens = sum(n for _, n, _ in context)
    return AttentionMetadata(
        num_contexts=len(context),
        num_generations=len(generation),
        num_ctx_tokens=num_ctx_tokens,
        num_tokens=num_tokens,
        seq_lens_cpu=seq_lens,
        num_cached_tokens_cpu=cached,
        seq_lens=seq_lens.to(device),
        num_cached_tokens=cached.to(device),
        cu_seqlens_q=cu.to(device),
        block_tables=block_tables.to(device),
        slot_mapping=slot_mapping.to(device),
        seq_slots=seq_slots.to(device),
        seq_slots_cpu=seq_slots,
        kv_cache_manager=manager,  # type: ignore[arg-type]
        tokens_per_block=tokens_per_block,
    )


def blocks_needed(num_tokens: int, tokens_per_block: int) -> int:
    return math.ceil(num_tokens / tokens_per_block)


# One step: (context [(rid, num_new, num_cached)], generation [(rid, num_cached)]).
Step = tuple[list[tuple[int, int, int]], list[tuple[int, int]]]


def chunked_schedule(prompt_lens: Sequence[int], chunked: int, num_decode: int) -> list[Step]:
    """Step 0 prefills every prompt (request `chunked` only its first half); step 1 finishes
    that chunk (with a cached prefix) while the others decode; then `num_decode` decode steps."""
    first = prompt_lens[chunked] // 2
    ctx0 = [(r, first if r == chunked else n, 0) for r, n in enumerate(prompt_lens)]
    ctx1 = [(chunked, prompt_lens[chunked] - first, first)]
    gen1 = [(r, n) for r, n in enumerate(prompt_lens) if r != chunked]
    steps: list[Step] = [(ctx0, []), (ctx1, gen1)]
    past = [n + (0 if r == chunked else 1) for r, n in enumerate(prompt_lens)]
    for _ in range(num_decode):
        steps.append(([], [(r, past[r]) for r in range(len(prompt_lens))]))
        past = [p + 1 for p in past]
    return steps


def step_rows(step: Step) -> list[tuple[int, int, int]]:
    """(rid, first position, num_new) per request of the step, in batch order."""
    ctx, gen = step
    return [(r, c, n) for r, n, c in ctx] + [(r, c, 1) for r, c in gen]


def run_schedule(
    model: torch.nn.Module,
    manager: FakeKVCacheManager,
    sequences: Sequence[torch.Tensor],
    schedule: Sequence[Step],
    positions: Sequence[torch.Tensor] | None = None,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """Run `model` over `schedule`, feeding tokens from `sequences[rid]` ([L] each) and
    positions from `positions[rid]` ([L] or [3, L]; default arange). Returns each step's
    last-token logits `[num_seqs, vocab]`. `device`: where the step's tensors go."""
    outputs = []
    for step in schedule:
        rows = step_rows(step)
        md = build_metadata(manager, *step, device=device)
        ids = torch.cat([sequences[r][c : c + n] for r, c, n in rows]).to(device)
        if positions is None:
            pos = torch.cat([torch.arange(c, c + n) for _, c, n in rows])[None]
        else:
            pos = torch.cat([positions[r][..., c : c + n] for r, c, n in rows], dim=-1)
            pos = pos[:, None] if pos.dim() == 2 else pos[None]
        with torch.no_grad():
            outputs.append(model(md, input_ids=ids, position_ids=pos.to(device)))
    return outputs


def randomize_(module: torch.nn.Module, seed: int, scale: float = 0.15) -> None:
    """Larger-than-default random weights (norm weights around 1) so real mismatches show up
    in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * scale
            p.copy_(1.0 + noise if "norm" in name else noise)


def assert_schedule_parity(
    model: torch.nn.Module,
    manager: FakeKVCacheManager,
    sequences: Sequence[torch.Tensor],
    schedule: Sequence[Step],
    reference_logits: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor] | None = None,
    atol: float = 1e-4,
) -> None:
    """Each step's last-token logits equal the reference's full-sequence logits `[L, vocab]`
    (per request) at the same positions."""
    outputs = run_schedule(model, manager, sequences, schedule, positions)
    for i, (step, logits) in enumerate(zip(schedule, outputs, strict=True)):
        rows = step_rows(step)
        expected = torch.stack([reference_logits[r][c + n - 1] for r, c, n in rows])
        assert logits.shape == expected.shape, f"step {i}"
        torch.testing.assert_close(logits, expected, atol=atol, rtol=atol, msg=f"step {i}")
