"""MTPDrafter: the next k draft tokens of each request from the checkpoint's MTP head.

Position i of the head takes the target's final-normed hidden state h_i and the embedding of
token i + 1, and predicts token i + 2 (`modeling_qwen3_5_mtp.py`). Its attention has its own
KV layers, so every position of a sequence must pass through it once:

- pass 1 (one chunk per request): the positions this step's target forward covered (a prompt
  chunk, or a verify row's accepted part), with the tokens that followed them: the prompt's,
  then the sampled token, or the accepted drafts and the bonus token. Its last row gives draft 1.
- passes 2..k (one token per request): the previous pass's MTP hidden state and the embedding
  of the previous draft, one position further. Their KV writes lie past the accepted tokens
  and are overwritten when the next step's pass 1 covers those positions.

Drafts stay on the device between passes; the host gets them with one copy at the end.

The passes read host arrays only (`DraftPlan`: rows, KV positions, block tables, next tokens),
built once per step from the requests. Under tensor parallelism rank 0 sends the plan and
each pass's draft tokens to the worker ranks (`tp_spec.py`), which run the same passes on
their shards of the head: the collectives of every pass match, and a worker feeds the next
pass rank 0's tokens, never its own argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...._utils import async_tensor_h2d
from ...attention_backend.interface import AttentionMetadata

if TYPE_CHECKING:
    from ...models.modeling_qwen3_next import Qwen3_5TextForCausalLM
    from ..llm_request import LlmRequest
    from ..resource_manager import KVCacheManager


@dataclass
class DraftRow:
    """One request's pass-1 chunk: rows [offset, offset + len(next_ids)) of the step's hidden
    states, at KV positions start.., followed by `next_ids`; `num_drafts` tokens wanted."""

    request: LlmRequest
    offset: int
    start: int
    next_ids: list[int]
    num_drafts: int


# A pass's greedy draft tokens -> the ones every rank uses (tensor parallelism: rank 0's).
ShareTokens = Callable[[torch.Tensor], torch.Tensor]
_PLAN_FIELDS = 6  # int64 entries per row of a packed plan, before its block table


@dataclass(frozen=True)
class DraftPlan:
    """Every host input of one step's MTP passes, per draft row (int64 numpy arrays)."""

    offsets: np.ndarray  # [n] first row of the row's chunk in the step's hidden states
    lens: np.ndarray  # [n] its pass-1 positions
    starts: np.ndarray  # [n] KV position of the first of them
    num_drafts: np.ndarray  # [n] draft tokens wanted (0: pass 1 only, for the KV)
    seq_slots: np.ndarray  # [n]
    num_blocks: np.ndarray  # [n] KV blocks the request holds
    block_table: np.ndarray  # [n, width] its block ids, -1 past num_blocks
    next_ids: np.ndarray  # [sum(lens)] the token after each pass-1 position

    @property
    def num_rows(self) -> int:
        return int(self.offsets.shape[0])

    def pack(self) -> torch.Tensor:
        """One int64 host tensor: the per-row fields, the block table, the next ids."""
        rows = np.stack(
            [
                self.offsets,
                self.lens,
                self.starts,
                self.num_drafts,
                self.seq_slots,
                self.num_blocks,
            ]
        )
        flat = np.concatenate([rows.reshape(-1), self.block_table.reshape(-1), self.next_ids])
        return torch.from_numpy(flat.astype(np.int64))

    @classmethod
    def unpack(cls, flat: torch.Tensor, num_rows: int, width: int) -> DraftPlan:
        """`pack`'s tensor (on the host) back into a plan of `num_rows` rows."""
        a = flat.numpy().astype(np.int64)
        head = _PLAN_FIELDS * num_rows
        offsets, lens, starts, num_drafts, seq_slots, num_blocks = a[:head].reshape(
            _PLAN_FIELDS, num_rows
        )
        table = a[head : head + num_rows * width].reshape(num_rows, width)
        return cls(
            offsets,
            lens,
            starts,
            num_drafts,
            seq_slots,
            num_blocks,
            block_table=table,
            next_ids=a[head + num_rows * width :],
        )


def _spans(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """`arange(start, start + len)` of each row, concatenated (int64)."""
    firsts = np.cumsum(lens) - lens
    return np.repeat(starts - firsts, lens) + np.arange(int(lens.sum()), dtype=np.int64)


class MTPDrafter:
    def __init__(
        self,
        lm: Qwen3_5TextForCausalLM,
        kv_cache_manager: KVCacheManager,
        tokens_per_block: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        if lm.mtp is None:
            raise ValueError("MTP drafting needs a model built with its MTP head (with_mtp)")
        self.lm = lm
        self.mtp = lm.mtp
        self.kv_cache_manager = kv_cache_manager
        self.tokens_per_block = tokens_per_block
        self.vocab_size = vocab_size
        self.device = device

    def plan(self, rows: Sequence[DraftRow]) -> DraftPlan:
        """The host inputs of `rows`' passes (block tables from the KV cache manager)."""
        blocks = [self.kv_cache_manager.get_block_array(r.request.request_id) for r in rows]
        width = max(b.shape[0] for b in blocks)
        table = np.full((len(rows), width), -1, dtype=np.int64)
        for i, b in enumerate(blocks):
            table[i, : b.shape[0]] = b

        def ints(values: Sequence[int | None]) -> np.ndarray:
            return np.asarray(values, dtype=np.int64)

        return DraftPlan(
            offsets=ints([r.offset for r in rows]),
            lens=ints([len(r.next_ids) for r in rows]),
            starts=ints([r.start for r in rows]),
            num_drafts=ints([r.num_drafts for r in rows]),
            seq_slots=ints([r.request.seq_slot for r in rows]),
            num_blocks=ints([b.shape[0] for b in blocks]),
            block_table=table,
            next_ids=ints([t for r in rows for t in r.next_ids]),
        )

    def _metadata(
        self, plan: DraftPlan, live: np.ndarray, starts: np.ndarray, lens: np.ndarray
    ) -> AttentionMetadata:
        """Chunk rows (`num_cached_tokens = start`) of the plan's rows `live` over their own
        KV blocks."""
        tpb = self.tokens_per_block
        seq_lens = lens.astype(np.int32)
        cached = starts.astype(np.int32)
        cu = np.zeros(len(live) + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=cu[1:])
        held = plan.num_blocks[live]
        table = plan.block_table[live][:, : int(held.max())].astype(np.int32)
        row = np.repeat(np.arange(len(live)), seq_lens)
        tok = _spans(starts, lens)
        # Past the request's claimed blocks (drafts beyond its last token): not written.
        inside = tok // tpb < held[row]
        slots = np.full(tok.shape[0], -1, dtype=np.int64)
        slots[inside] = (
            table[row[inside], tok[inside] // tpb].astype(np.int64) * tpb + tok[inside] % tpb
        )
        seq_slots = plan.seq_slots[live]
        dev = self.device

        def h2d(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return async_tensor_h2d(torch.from_numpy(a), dtype, dev)

        return AttentionMetadata(
            num_contexts=len(live),
            num_generations=0,
            num_ctx_tokens=int(cu[-1]),
            num_tokens=int(cu[-1]),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            num_cached_tokens_cpu=torch.from_numpy(cached),
            seq_lens=h2d(seq_lens, torch.int32),
            num_cached_tokens=h2d(cached, torch.int32),
            cu_seqlens_q=h2d(cu, torch.int32),
            block_tables=h2d(table, torch.int32),
            slot_mapping=h2d(slots, torch.int64),
            seq_slots=h2d(seq_slots, torch.int64),
            seq_slots_cpu=torch.from_numpy(seq_slots),
            kv_cache_manager=self.kv_cache_manager,
            tokens_per_block=tpb,
        )

    def _step(
        self,
        md: AttentionMetadata,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        step: int,
        last: torch.Tensor,
        share: ShareTokens | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP pass -> (its hidden states at `last` rows, their greedy draft tokens)."""
        cos_sin = self.lm.model.get_cos_sin(positions)
        out = self.mtp(embeds, hidden, cos_sin, md, step)
        out_last = out.index_select(0, last)
        logits = self.lm.lm_logits(out_last)[:, : self.vocab_size]
        token = logits.argmax(dim=-1)
        return out_last, token if share is None else share(token)

    @torch.inference_mode()
    def draft(
        self,
        rows: Sequence[DraftRow],
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        send_plan: Callable[[DraftPlan], None] | None = None,
        share: ShareTokens | None = None,
    ) -> list[list[int]]:
        """Drafts of each row (`num_drafts` tokens; [] for 0) from the step's final-normed
        `hidden: [T, H]` and `position_ids` (`[3, 1, T]` or `[1, T]`, deltas applied).
        Tensor parallelism, rank 0: `send_plan` sends the plan to the workers before the
        passes, `share` each pass's tokens (`tp_spec.SpecLink`)."""
        if not rows:
            return []
        plan = self.plan(rows)
        if send_plan is not None:
            send_plan(plan)
        table = self.run(plan, hidden, position_ids, share).tolist()  # the one copy of all
        return [table[i][: r.num_drafts] for i, r in enumerate(rows)]

    @torch.inference_mode()
    def run(
        self,
        plan: DraftPlan,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        share: ShareTokens | None = None,
    ) -> torch.Tensor:
        """Every MTP pass of `plan` -> the drafts `[num_rows, passes]` on the device (-1 where
        a row stopped drafting). A tensor-parallel worker calls it with rank 0's plan."""
        dev = hidden.device
        lens = plan.lens
        index = _spans(plan.offsets, lens)
        index_t = async_tensor_h2d(torch.from_numpy(index), torch.int64, dev)
        last = async_tensor_h2d(torch.from_numpy(np.cumsum(lens) - 1), torch.int64, dev)
        next_ids = async_tensor_h2d(torch.from_numpy(plan.next_ids), torch.int64, dev)
        embed = self.lm.model.embed_tokens
        positions = position_ids.index_select(-1, index_t)
        live = np.arange(plan.num_rows)  # rows still drafting, indices into the plan
        md = self._metadata(plan, live, plan.starts, lens)
        state, token = self._step(
            md, embed(next_ids), hidden.index_select(0, index_t), positions, 0, last, share
        )
        pos = positions.index_select(-1, last)  # each row's last position
        drafts = [token]
        ends = plan.starts + lens - 1
        for step in range(1, int(plan.num_drafts.max())):
            keep = np.flatnonzero(plan.num_drafts[live] > step)
            if len(keep) < len(live):
                sel = async_tensor_h2d(torch.from_numpy(keep), torch.int64, dev)
                state, token, pos = state[sel], token[sel], pos.index_select(-1, sel)
                live = live[keep]
            pos = pos + 1
            md = self._metadata(plan, live, ends[live] + step, np.ones(len(live), np.int64))
            rows_t = torch.arange(len(live), device=dev)
            state, token = self._step(md, embed(token), state, pos, step, rows_t, share)
            drafts.append(self._scatter(token, live, plan.num_rows, dev))
        return torch.stack(drafts, dim=1)

    @staticmethod
    def _scatter(
        token: torch.Tensor, live: np.ndarray, num_rows: int, dev: torch.device
    ) -> torch.Tensor:
        """`token` of the live rows placed at their row of a [num_rows] tensor (-1 elsewhere)."""
        out = torch.full((num_rows,), -1, dtype=torch.int64, device=dev)
        out.index_copy_(0, async_tensor_h2d(torch.from_numpy(live), torch.int64, dev), token)
        return out
