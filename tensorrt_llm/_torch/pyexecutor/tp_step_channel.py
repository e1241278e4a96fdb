"""The step channel of a tensor-parallel engine: rank 0 sends, the worker ranks receive.

Rank 0 owns the scheduler. Every time its engine runs a step it broadcasts the step's
`InputBatch` to the tp group in two (or three) collectives: a fixed int64 header (command and
sizes), one packed int64 tensor with every per-token / per-request array (ids, positions, slot
mapping, block tables, lengths, seq slots), and, only for steps with multimodal params, their
bytes (`torch.save`, loaded onto the worker's own device). Model weights never travel.
Hybrid prefix caching: the packed tensor also carries the step's inner-snapshot points
(`AttentionMetadata.recurrent_snapshots`, written by the forward into scratch slots) and the
recurrent-snapshot copies rank 0's pool made since the previous step (restores at
admission, saves after the previous forward), which the worker replays on its own pool before
the forward (`state_snapshot_pool.py`).
Prompt logprobs: the packed tensor also carries the plan's rows and targets, so the worker runs
the same hidden-state forward and LM-head slices (`run_step`): the vocab-parallel LM head is a
collective per slice, and each rank's vocabulary shard must be of the same rows.
Commands besides a step: a new KV cache (its block count: block ids must mean the same
memory on every rank), the KV sizing (each rank answers the blocks its own free memory fits,
the ranks keep the minimum: `send_kv_budget`), the snapshot pool's entry count (the
minimum too: `send_snapshot_pool`), the parts of an MTP speculative step
(`send_spec` / `share`, spec_decode/tp_spec.py), the vision embedding cache (its
capacity, sent where rank 0 builds its own: `send_vision_cache`), and stop.

NOTE: only a tensor-parallel engine has a channel (`PyTorchModelEngine.step_channel` is None
otherwise), so a single-GPU step does no work here.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...mapping import Mapping
from ..attention_backend.interface import AttentionMetadata
from ..distributed import min_over_ranks, tp_group
from ..distributed.ops import collective_error
from ..input_batch import InputBatch
from .prompt_logprobs import PromptLogprobLayout, PromptLogprobsPlan

if TYPE_CHECKING:
    from .resource_manager import KVCacheManager
    from .state_snapshot_pool import RecurrentSnapshotPool

logger = logging.getLogger(__name__)

CMD_STEP = 1
CMD_KV_CACHE = 2
CMD_STOP = 3
CMD_KV_BUDGET = 4
CMD_SNAPSHOT_POOL = 5
CMD_SPEC = 6
CMD_VISION_CACHE = 7
_HEADER = 15  # int64 entries of the fixed header


@dataclass(frozen=True)
class KvCacheCommand:
    """Build (num_blocks > 0) or drop (0) the worker's KV cache."""

    num_blocks: int
    max_blocks_per_seq: int


@dataclass(frozen=True)
class KvBudgetCommand:
    """Answer `StepChannel.agree_min` with the KV blocks this rank's memory fits, at most
    rank 0's `proposed_blocks`, after `reserved_bytes` (rank 0's reservations besides the
    probe's activation peak: snapshots, caches) are set aside."""

    proposed_blocks: int
    reserved_bytes: int


@dataclass(frozen=True)
class SnapshotPoolCommand:
    """Answer `StepChannel.agree_min` with the recurrent snapshots this rank's pool fits (at
    most rank 0's `proposed_entries`), then build a pool of the agreed count."""

    proposed_entries: int


@dataclass(frozen=True)
class SpecCommand:
    """A part of an MTP speculative step (spec_decode/tp_spec.py): rank 0's header values and
    the int64 payload that followed them (a host tensor)."""

    values: tuple[int, ...]
    payload: torch.Tensor


@dataclass(frozen=True)
class VisionCacheCommand:
    """Build the worker's vision embedding cache now (rank 0 built its own at this point):
    every rank's cache then sees the same lookups and puts, so the same hits and evictions."""

    capacity_bytes: int


class StepChannel:
    """Broadcasts from the tp group's first rank; `receive()` on the others."""

    def __init__(self, mapping: Mapping, device: torch.device) -> None:
        if not mapping.has_tp:
            raise ValueError("a step channel is for tensor_parallel_size > 1")
        self.mapping = mapping
        self.device = device
        self.group = tp_group(mapping)
        self.src = mapping.tp_group[0]
        # gloo broadcasts host tensors, NCCL device ones.
        self.wire = device if device.type == "cuda" else torch.device("cpu")
        # Rank 0 with hybrid prefix caching: the pool whose copies each step carries.
        self.snapshots: RecurrentSnapshotPool | None = None
        # A worker: the snapshot copies of the step `receive` returned last.
        self.snapshot_copies: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ rank 0
    def send_step(self, batch: InputBatch) -> None:
        md = batch.attn_metadata
        num_seqs, width = md.block_tables.shape
        pos_axes = batch.position_ids.shape[0] if batch.position_ids.dim() == 3 else 1
        media = _pack_objects(batch.multimodal_params) if batch.multimodal_params else None
        inner = [v for point in md.recurrent_snapshots for v in point]
        copies = [] if self.snapshots is None else self.snapshots.take_copies()
        flat_copies = [v for copy in copies for v in copy]
        header = [
            CMD_STEP,
            md.num_contexts,
            md.num_generations,
            md.num_ctx_tokens,
            md.num_tokens,
            md.tokens_per_block,
            num_seqs,
            width,
            md.slot_mapping.shape[0],
            pos_axes,
            int(batch.return_context_logits),
            0 if media is None else media.numel(),
            len(md.recurrent_snapshots),
            len(copies),
            _prompt_rows(batch),
        ]
        self._broadcast_header(header)
        num_tokens = md.num_tokens
        parts = [
            md.seq_lens,
            md.num_cached_tokens,
            md.seq_slots,
            md.cu_seqlens_q,
            md.block_tables.reshape(-1),
            md.slot_mapping,
            batch.input_ids[:num_tokens],
            batch.position_ids.reshape(pos_axes, -1)[:, :num_tokens].reshape(-1),
        ]
        parts.append(torch.tensor(inner + flat_copies, dtype=torch.int64))
        if batch.prompt_logprobs is not None:
            parts += [batch.prompt_logprobs.rows, batch.prompt_logprobs.targets]
        packed = torch.cat([p.to(self.wire, torch.int64) for p in parts])
        self._broadcast(packed)
        if media is not None:
            self._broadcast(media.to(self.wire))

    def send_kv_cache(self, kv: KVCacheManager | None) -> None:
        sizes = (0, 0) if kv is None else (kv.num_blocks, kv.max_blocks_per_seq)
        self._broadcast_header([CMD_KV_CACHE, *sizes])

    def send_kv_budget(self, proposed_blocks: int, reserved_bytes: int) -> int:
        """The KV block count every rank can allocate: the minimum of rank 0's and each
        worker's answer (before any of them allocates, so no rank runs out first)."""
        self._broadcast_header([CMD_KV_BUDGET, proposed_blocks, reserved_bytes])
        return self.agree_min(proposed_blocks)

    def send_snapshot_pool(self, proposed_entries: int) -> int:
        """The recurrent snapshot entries every rank allocates: the minimum of rank 0's and
        each worker's count (entry indices must mean the same entry on every rank)."""
        self._broadcast_header([CMD_SNAPSHOT_POOL, proposed_entries])
        return self.agree_min(proposed_entries)

    def send_spec(self, values: list[int], payload: torch.Tensor) -> None:
        """A speculative step's part (`SpecCommand`): the header, then `payload` (int64)."""
        self._broadcast_header([CMD_SPEC, payload.numel(), *values])
        if payload.numel():
            self._broadcast(payload.to(self.wire, torch.int64))

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank (every rank calls it): rank 0 passes its own, a
        worker one of the same shape and dtype, whose values it gets back replaced."""
        wire = tensor.to(self.wire).contiguous()
        self._broadcast(wire)
        return wire.to(tensor.device)

    def send_vision_cache(self, capacity_bytes: int) -> None:
        self._broadcast_header([CMD_VISION_CACHE, capacity_bytes])

    def agree_min(self, value: int) -> int:
        """The minimum of `value` over the tp group (every rank calls it)."""
        return min_over_ranks([value], self.mapping, self.device)[0]

    def send_stop(self) -> None:
        """Tell the workers to exit; ranks already gone are only logged (the engine's owner
        kills what is left: `executor/tp_ranks.py`)."""
        try:
            self._broadcast_header([CMD_STOP])
        except RuntimeError as exc:
            logger.warning("could not send stop to the tensor-parallel ranks: %s", exc)

    def _broadcast_header(self, values: list[int]) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self._broadcast(header.to(self.wire))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            dist.broadcast(tensor, self.src, group=self.group)
        except RuntimeError as exc:
            # NOTE: a dead rank surfaces here or in a layer's collective (gloo: connection
            # closed); the engine process's watcher stops the engine (executor/tp_ranks.py).
            raise collective_error("step broadcast", exc) from exc

    # ------------------------------------------------------------------ workers
    def receive(
        self,
    ) -> (
        InputBatch
        | KvCacheCommand
        | KvBudgetCommand
        | SnapshotPoolCommand
        | SpecCommand
        | VisionCacheCommand
        | None
    ):
        """The next command: a step's batch (its snapshot copies in `snapshot_copies`), a
        KV-cache, KV-sizing, snapshot-pool, speculative-step or vision-cache command, or None
        for stop."""
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.wire)
        dist.broadcast(header, self.src, group=self.group)
        h = header.tolist()
        if h[0] == CMD_STOP:
            return None
        if h[0] == CMD_KV_CACHE:
            return KvCacheCommand(h[1], h[2])
        if h[0] == CMD_KV_BUDGET:
            return KvBudgetCommand(h[1], h[2])
        if h[0] == CMD_SNAPSHOT_POOL:
            return SnapshotPoolCommand(h[1])
        if h[0] == CMD_SPEC:
            return self._receive_spec(h)
        if h[0] == CMD_VISION_CACHE:
            return VisionCacheCommand(h[1])
        if h[0] != CMD_STEP:
            raise RuntimeError(f"unknown step-channel command {h[0]} from rank {self.src}")
        return self._receive_step(h)

    def _receive_spec(self, h: list[int]) -> SpecCommand:
        payload = torch.empty(h[1], dtype=torch.int64, device=self.wire)
        if h[1]:
            dist.broadcast(payload, self.src, group=self.group)
        return SpecCommand(tuple(h[2:]), payload.cpu())

    def _receive_step(self, h: list[int]) -> InputBatch:
        num_ctx, num_gen, num_ctx_tokens, num_tokens, tpb = h[1:6]
        num_seqs, width, padded, pos_axes, context_logits, media_bytes = h[6:12]
        num_inner, num_copies, num_prompt_rows = h[12:15]
        sizes = [
            num_seqs,
            num_seqs,
            num_seqs,
            num_seqs + 1,
            num_seqs * width,
            padded,
            num_tokens,
            pos_axes * num_tokens,
            3 * num_inner,
            3 * num_copies,
            2 * num_prompt_rows,
        ]
        packed = torch.empty(sum(sizes), dtype=torch.int64, device=self.wire)
        dist.broadcast(packed, self.src, group=self.group)
        lens, cached, slots, cu, tables, slot_mapping, ids, pos, inner, copies, prompt = packed.to(
            self.device
        ).split(sizes)
        # NOTE: read on the host only when there are any (a device tensor's tolist syncs).
        inner_points = _triples(inner) if num_inner else []
        self.snapshot_copies = _triples(copies) if num_copies else []
        params: list[Any] = []
        if media_bytes:
            raw = torch.empty(media_bytes, dtype=torch.uint8, device=self.wire)
            dist.broadcast(raw, self.src, group=self.group)
            params = _unpack_objects(raw, self.device)
        int32 = torch.int32
        positions = pos.to(int32).reshape(pos_axes, 1, num_tokens)
        md = AttentionMetadata(
            num_contexts=num_ctx,
            num_generations=num_gen,
            num_ctx_tokens=num_ctx_tokens,
            num_tokens=num_tokens,
            seq_lens_cpu=lens.to(int32).cpu(),
            num_cached_tokens_cpu=cached.to(int32).cpu(),
            seq_lens=lens.to(int32),
            num_cached_tokens=cached.to(int32),
            cu_seqlens_q=cu.to(int32),
            block_tables=tables.to(int32).reshape(num_seqs, width),
            slot_mapping=slot_mapping,
            seq_slots=slots,
            seq_slots_cpu=slots.cpu(),
            kv_cache_manager=None,  # the worker's own, set by its loop
            tokens_per_block=tpb,
            recurrent_snapshots=tuple(inner_points),
        )
        return InputBatch(
            attn_metadata=md,
            input_ids=ids,
            position_ids=positions if pos_axes == 3 else positions[0],
            multimodal_params=params,
            return_context_logits=bool(context_logits),
            prompt_logprobs=_worker_prompt_plan(prompt) if num_prompt_rows else None,
        )


def _prompt_rows(batch: InputBatch) -> int:
    plan = batch.prompt_logprobs
    return 0 if plan is None else int(plan.rows.shape[0])


def _worker_prompt_plan(rows_and_targets: torch.Tensor) -> PromptLogprobsPlan:
    """Rank 0's rows and targets with no requests: the worker runs the same LM-head slices
    over the same rows (the vocab-parallel head's collectives), and drops the entries."""
    rows, targets = rows_and_targets.chunk(2)
    return PromptLogprobsPlan(PromptLogprobLayout((), (), (), 0), rows, targets)


def _triples(flat: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(a, b, c) for a, b, c in flat.reshape(-1, 3).tolist()]


def _pack_objects(value: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpack_objects(raw: torch.Tensor, device: torch.device) -> Any:
    data = raw.cpu().numpy().tobytes()
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)
