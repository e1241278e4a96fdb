"""Prefix caching for hybrid models (Qwen3.5 / 3.6): KV block reuse plus recurrent-state
snapshots at block-aligned positions (the approach of SGLang's Mamba radix cache and vLLM's
aligned prefix caching).

A request may start at a cached prefix only where the DeltaNet conv / SSM state after that
prefix is known too, so the usable hit is the longest run of cached blocks whose LAST block has
a snapshot (`RecurrentSnapshotPool`, keyed by that block's key, dropped when it is evicted).
At admission the snapshot is copied into the request's new seq slot; its first chunk then
starts at the hit with `num_cached_tokens > 0`, so the DeltaNet layers read the slot's state
as if an earlier chunk had run (the path chunked prefill already takes).

Where snapshots come from (all device copies queued right after the forward that wrote the
state, in `register_step`, on the one stream):
- prefill: at each snapshot point of the context: the last aligned position before the last
  context token, `((len - 1) // tpb) * tpb`, which a
  repeat of the same prompt can hit, and the last aligned position at or before the first
  media run, which the same text with another image can hit, and the end of the cached KV
  when the hit had to stop at least `MIN_DIVERGENCE_GAIN_BLOCKS` short of it for want of a
  snapshot (requests sharing a prefix longer than any snapshot, e.g. one system prompt: the
  next of them hits it all). A point inside a step's chunk does not end the chunk
  (`plan_step`): the request's `inner_snapshot` names it and a scratch seq slot, the
  DeltaNet layers write the state at the point into the scratch slot's rows while they run
  the chunk (gated_delta_net_snapshot.py), and `register_step` copies that slot into the pool
  and frees it. Scratch slots are rows of their own past the scheduler's
  (`snapshot_scratch_slots`): at capacity every scheduler slot holds a request, and a full
  batch is when the step a chunk end costs hurts most. One point per request and step: a
  chunk that would hold two ends at the second (`chunk_limit`), which is then snapshotted as
  a chunk end; with every scratch slot taken the chunk ends at the point instead. A chunk end
  on a point or on a block boundary that ends the context is snapshotted from the request's
  own slot. `INNER_SNAPSHOT_ENV=0` brings back
  ending a chunk at every point (one more forward per point: +40% turn-1 TTFT on the H200).
- decode: when a step makes the sequence a multiple of tpb long, the slot's state is copied
  into the request's pending entry (overwritten at the next crossing: one entry per running
  request, whatever its length). Its block key is known only once the tokens are on the host,
  so it is committed when the request stops normally (`register_finished`): the next turn of
  a chat (history + answer + new question) then hits up to the answer's last aligned point
  (when the answer comes back as the same tokens: a template that drops the reasoning of
  earlier turns, or a detokenize / re-encode that differs, makes the prompt-end snapshot the
  one that hits). The snapshot the request was restored from is then demoted (evicted
  first): the next turn starts further along the same chain. Pending entries take at most
  half the pool, so the keyed snapshots that hits need keep the other half.
Pending entries are freed when the request leaves (`on_released`: finished, failed,
preempted); a resumed request is matched and restored again like a new one, so recompute
gives the same tokens.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .block_hash import BlockKey
from .capacity import recurrent_state_bytes_per_slot
from .kv_cache_reuse import KvCacheReuse
from .llm_request import LlmRequest
from .state_snapshot_pool import RecurrentSnapshotPool, snapshot_bytes

if TYPE_CHECKING:
    from .engine_config import EngineConfig
    from .model_engine import PyTorchModelEngine
    from .resource_manager import KVCacheManager
    from .scheduler import ScheduledRequests

logger = logging.getLogger(__name__)

# Prefix of the recurrent entries of `EngineModel.per_slot_state` (modeling_qwen3_next.py).
RECURRENT_STATE_PREFIX = "recurrent."
# The pool's default bound (recurrent_state_snapshot_mib=None). On CUDA a share of the memory
# free after the weights and the probe (what the KV cache is sized from), at most the cap: one
# Qwen3.6-27B snapshot is 146.8 MiB (48 DeltaNet layers, fp32 SSM state), so 16 GiB holds 111:
# at most 55 pending (one per running request) and, per conversation between its turns, its
# prompt-end and committed decode snapshots (the 32-conversation multi-turn benchmark: ~64).
DEFAULT_SNAPSHOT_POOL_SHARE = 0.2
DEFAULT_SNAPSHOT_POOL_CAP_MIB = 16384
DEFAULT_SNAPSHOT_POOL_CPU_MIB = 256
# ... raised to `DEFAULT_SNAPSHOTS_PER_SLOT` entries for every seq slot when the share holds
# fewer (a full batch of chats then keeps what its next turns hit: one more than a chat holds,
# for the pending entries of a wave), but never past this share of the free memory.
DEFAULT_SNAPSHOTS_PER_SLOT = 4
DEFAULT_SNAPSHOT_POOL_MAX_SHARE = 0.4
# A divergence point is added only when it would lengthen the usable hit by this many blocks:
# in a chat the next turn's cached KV runs just past the previous prompt's snapshot (to where
# the re-rendered answer parts from the generated one), which is not worth an entry and a step.
MIN_DIVERGENCE_GAIN_BLOCKS = 4
# "0": end a prefill chunk at every snapshot point instead of snapshotting inside the chunk
# (the A/B switch of the module docstring); read when the reuse is built.
INNER_SNAPSHOT_ENV = "TRTLLM_HYBRID_INNER_SNAPSHOT"
# Entries a chat holds while its next turn runs: the previous turn's committed snapshot (until
# the request is admitted), the new prompt-end one and its pending decode one. Fewer make a
# full batch of chats evict what later turns hit (benchmarks/results/qwen3_6_27b_h200.md).
SNAPSHOTS_PER_CONVERSATION = 3
# Seq slots kept for inner snapshots, past the scheduler's: one per context request of a step
# whose chunk holds a point (a 1000-token prompt's chunk holds its prompt-end point, so about
# max_num_tokens / prompt length of them per step). One Qwen3.6-27B slot is 146.8 MiB.
SNAPSHOT_SCRATCH_SLOTS = 8


def inner_snapshots_on() -> bool:
    """Whether snapshot points inside a chunk are taken there (`INNER_SNAPSHOT_ENV`)."""
    return os.environ.get(INNER_SNAPSHOT_ENV, "1") != "0"


def snapshot_scratch_slots(config: EngineConfig) -> int:
    """Seq slots the model holds past `max_batch_size` for inner snapshots: 0 unless block
    reuse is on for a hybrid model with inner snapshots (`INNER_SNAPSHOT_ENV`). The same on
    every tensor-parallel rank (it reads the config and the environment only)."""
    if not config.enable_block_reuse or not inner_snapshots_on():
        return 0
    if not recurrent_state_bytes_per_slot(config.text_config, config.dtype):
        return 0
    return SNAPSHOT_SCRATCH_SLOTS


def recurrent_slot_state(model_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The conv / SSM per-slot tensors of a hybrid model (`SlotState.model_state`)."""
    return {n: t for n, t in model_state.items() if n.startswith(RECURRENT_STATE_PREFIX)}


class HybridKvCacheReuse(KvCacheReuse):
    """`KvCacheReuse` whose hits end only where a recurrent snapshot exists (module docstring)."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        snapshots: RecurrentSnapshotPool,
        spatial_merge_size: int = 1,
        scratch_slots: Sequence[int] = (),
    ) -> None:
        super().__init__(kv_cache_manager, spatial_merge_size)
        self.snapshots = snapshots
        kv_cache_manager.pool.on_evict = snapshots.drop
        self._pending_len: dict[int, int] = {}  # request id -> tokens its pending entry covers
        self._restored: dict[int, BlockKey] = {}  # request id -> the key it started from
        # The last `match`: (request id, tokens of its cached KV before the snapshot trim).
        self._last_match: tuple[int, int] = (-1, 0)
        # Request id -> the end of its cached KV where no snapshot was: one more point.
        self._divergence: dict[int, int] = {}
        self.inner_snapshots = inner_snapshots_on()
        # Requests holding a scratch slot (`plan_step` to `register_step`), and the free ones
        # (rows of the model's state past the scheduler's slots: `snapshot_scratch_slots`).
        self._scratch: dict[int, LlmRequest] = {}
        self._free_scratch_slots = sorted(scratch_slots)  # a heap: the lowest first

    # ---- admission ---------------------------------------------------------------------------
    def match(self, req: LlmRequest) -> list[int]:
        hit = super().match(req)
        keys = req.block_keys
        n = len(hit)
        while n and not self.snapshots.has(keys[n - 1]):
            n -= 1
        self._last_match = (req.request_id, len(hit) * self.tokens_per_block)
        return hit[:n]

    def on_admitted(self, req: LlmRequest, hit_blocks: list[int]) -> None:
        super().on_admitted(req, hit_blocks)
        rid, kv_hit = self._last_match
        gain = MIN_DIVERGENCE_GAIN_BLOCKS * self.tokens_per_block
        if rid == req.request_id and kv_hit >= len(hit_blocks) * self.tokens_per_block + gain:
            # Other requests share its KV further than any snapshot: snapshot where they part.
            self._divergence[rid] = kv_hit
        if hit_blocks:
            if req.seq_slot is None:
                raise RuntimeError(f"request {req.request_id} admitted without a seq slot")
            key = req.block_keys[len(hit_blocks) - 1]
            self.snapshots.restore(key, req.seq_slot)
            self._restored[req.request_id] = key

    # ---- prefill snapshot points -------------------------------------------------------------
    def snapshot_points(self, req: LlmRequest) -> list[int]:
        """Aligned context positions, ascending, where a chunk should end to be snapshotted."""
        if req.block_reuse_off:
            return []
        tpb = self.tokens_per_block
        points = {(req.context_len - 1) // tpb * tpb}
        spans = self._spans(req)
        if spans:
            points.add(spans[0].start // tpb * tpb)
        divergence = self._divergence.get(req.request_id)
        if divergence is not None:
            points.add(divergence)
        return sorted(p for p in points if p > 0)

    def chunk_limit(self, req: LlmRequest, remaining: int) -> int:
        pos = req.context_current_position
        inside = [p for p in self.snapshot_points(req) if pos < p < pos + remaining]
        # Inside a chunk one point is taken per step (`plan_step`): a second one ends it.
        keep = 1 if self.inner_snapshots else 0
        return inside[keep] - pos if len(inside) > keep else remaining

    def plan_step(self, scheduled: ScheduledRequests) -> None:
        """Give each context request whose chunk holds a snapshot point strictly inside it a
        scratch seq slot for the state there (`inner_snapshot`); without a free one its
        chunk ends at the point. Runs once the step's chunks are sized, after admissions."""
        for req in list(self._scratch.values()):  # a step that never registered (spec decode)
            self._free_scratch(req)
        if not self.inner_snapshots:
            return
        for req in scheduled.context_requests:
            pos = req.context_current_position
            end = pos + req.context_chunk_size
            inside = [p for p in self.snapshot_points(req) if pos < p < end]
            if not inside or req.seq_slot is None:
                continue
            if not self._free_scratch_slots:
                req.context_chunk_size = inside[0] - pos  # the old way: one more step
                continue
            req.inner_snapshot = (inside[-1], heapq.heappop(self._free_scratch_slots))
            self._scratch[req.request_id] = req

    @property
    def num_free_scratch_slots(self) -> int:
        return len(self._free_scratch_slots)

    def _free_scratch(self, req: LlmRequest) -> None:
        self._scratch.pop(req.request_id, None)
        if req.inner_snapshot is not None:
            heapq.heappush(self._free_scratch_slots, req.inner_snapshot[1])
        req.inner_snapshot = None

    # ---- snapshots after a step --------------------------------------------------------------
    def register_step(self, scheduled: ScheduledRequests) -> None:
        super().register_step(scheduled)
        tpb = self.tokens_per_block
        for req in scheduled.context_requests:
            if req.inner_snapshot is not None:
                # The forward wrote the state at the point into the scratch slot: copy it
                # (queued after that forward), then the slot can serve the next step.
                point, scratch = req.inner_snapshot
                keys = self.block_keys(req, point)
                if len(keys) == point // tpb:
                    self.snapshots.save(keys[-1], scratch)
                self._free_scratch(req)
            end = req.context_current_position + req.context_chunk_size
            if end % tpb or req.block_reuse_off or req.seq_slot is None:
                continue
            if end == req.context_len or end in self.snapshot_points(req):
                keys = self.block_keys(req, end)
                if len(keys) == end // tpb:
                    self.snapshots.save(keys[-1], req.seq_slot)
        for req in scheduled.generation_requests:
            # The step's input token is the sequence's last: its state now covers them all.
            covered = req.num_tokens
            if covered % tpb or req.block_reuse_off or req.seq_slot is None:
                continue
            if self.snapshots.save_pending(req.request_id, req.seq_slot):
                self._pending_len[req.request_id] = covered
            else:
                self._pending_len.pop(req.request_id, None)

    def register_finished(self, req: LlmRequest) -> None:
        super().register_finished(req)
        rid = req.request_id
        covered = self._pending_len.pop(rid, None)
        if covered is None or req.finish_reason not in ("stop", "length"):
            return
        tpb = self.tokens_per_block
        if covered > req.prompt_len + req.num_generated_tokens:
            return  # not every token it covers is known (cannot happen after a normal stop)
        keys = self.block_keys(req, covered)
        # Committed only while its block is cached: the last answer token's KV (and so the
        # block it ends) is never written, and such a snapshot could never be hit.
        if len(keys) != covered // tpb or not self.kv.pool.is_cached(keys[-1]):
            return
        restored = self._restored.get(rid)
        if self.snapshots.commit(rid, keys[-1]) and restored is not None:
            # A chat's previous turn is not sent again: the turn after this one will start
            # from this request's snapshots, further along the same chain.
            self.snapshots.demote(restored)

    def on_released(self, req: LlmRequest) -> None:
        self.snapshots.release(req.request_id)
        self._pending_len.pop(req.request_id, None)
        self._restored.pop(req.request_id, None)
        self._divergence.pop(req.request_id, None)
        if req.request_id in self._scratch:
            self._free_scratch(req)


def default_pool_bytes(free: int, entry_bytes: int, batch_slots: int) -> int:
    """The default bound on a GPU with `free` bytes: the share (at most the cap), raised to
    `DEFAULT_SNAPSHOTS_PER_SLOT` entries a seq slot, at most `DEFAULT_SNAPSHOT_POOL_MAX_SHARE`."""
    share = min(int(free * DEFAULT_SNAPSHOT_POOL_SHARE), DEFAULT_SNAPSHOT_POOL_CAP_MIB * 2**20)
    want = DEFAULT_SNAPSHOTS_PER_SLOT * batch_slots * entry_bytes
    return min(max(share, want), int(free * DEFAULT_SNAPSHOT_POOL_MAX_SHARE))


def default_snapshot_pool_bytes(device: torch.device, entry_bytes: int, batch_slots: int) -> int:
    """The pool's bound when recurrent_state_snapshot_mib is not given (see the constants)."""
    if device.type != "cuda":
        return DEFAULT_SNAPSHOT_POOL_CPU_MIB * 2**20
    torch.cuda.empty_cache()  # the probe's peak sits in the caching allocator
    free, _total = torch.cuda.mem_get_info(device)
    return default_pool_bytes(free, entry_bytes, batch_slots)


def snapshot_pool_bytes(
    config: EngineConfig, device: torch.device, entry_bytes: int, batch_slots: int
) -> int:
    """The pool's byte bound: recurrent_state_snapshot_mib, else the default for snapshots of
    `entry_bytes` and `batch_slots` seq slots."""
    max_bytes = config.recurrent_state_snapshot_bytes
    if max_bytes is None:
        return default_snapshot_pool_bytes(device, entry_bytes, batch_slots)
    return max_bytes


def make_snapshot_pool(
    config: EngineConfig, engine: PyTorchModelEngine, batch_slots: int
) -> RecurrentSnapshotPool | None:
    """The snapshot pool of a hybrid model with block reuse on (None for other models), of
    `config.recurrent_state_snapshot_bytes` (None: `default_snapshot_pool_bytes`); allocated at
    once on the model's device. `batch_slots`: the seq slots requests can hold (a warning
    when the pool holds fewer than `SNAPSHOTS_PER_CONVERSATION` entries for each)."""
    if not engine.model.is_hybrid:
        return None
    state = recurrent_slot_state(engine.slot_state.model_state)
    if not state:
        raise RuntimeError(
            f"{type(engine.model).__name__} is hybrid but lists no '{RECURRENT_STATE_PREFIX}*' "
            "per-slot state: block reuse cannot snapshot it"
        )
    entry_bytes = snapshot_bytes(state)
    max_bytes = snapshot_pool_bytes(config, engine.device, entry_bytes, batch_slots)
    channel = engine.step_channel
    entries = None
    if channel is not None:
        # Tensor parallelism: rank 0's pool picks every entry and the workers copy by index,
        # so all ranks hold the least count any rank's memory fits (tp_worker.py).
        own = max_bytes // entry_bytes
        entries = channel.send_snapshot_pool(own)
        if entries < own:
            logger.info("snapshot pool: %d entries (a tensor-parallel rank fits fewer)", entries)
    pool = RecurrentSnapshotPool(state, max_bytes, entries)
    if channel is not None:
        pool.copy_log = []  # each step carries the copies made before it (StepChannel)
        channel.snapshots = pool
    logger.info(
        "block reuse on a hybrid model: %d recurrent-state snapshots of %.1f MiB (%.0f MiB, "
        "recurrent_state_snapshot_mib)",
        pool.capacity,
        pool.bytes_per_snapshot / 2**20,
        pool.nbytes / 2**20,
    )
    want = SNAPSHOTS_PER_CONVERSATION * batch_slots
    if pool.capacity < want:
        logger.warning(
            "the recurrent-state snapshot pool holds %d entries, fewer than %d for each of the "
            "%d seq slots: a full batch of multi-turn chats evicts snapshots the next turns "
            "need and prefills those turns from an earlier point; recurrent_state_snapshot_mib"
            "=%d holds %d (or lower max_batch_size)",
            pool.capacity,
            SNAPSHOTS_PER_CONVERSATION,
            batch_slots,
            -(-want * pool.bytes_per_snapshot // 2**20),
            want,
        )
    return pool


def make_kv_cache_reuse(
    kv_cache_manager: KVCacheManager,
    snapshots: RecurrentSnapshotPool | None,
    spatial_merge_size: int = 1,
    scratch_slots: Sequence[int] = (),
) -> KvCacheReuse:
    """The scheduler's `reuse`: with snapshots (a hybrid model) hits end at one of them, and
    `scratch_slots` (seq slots no request is given) hold the states inside chunks."""
    if snapshots is None:
        return KvCacheReuse(kv_cache_manager, spatial_merge_size)
    return HybridKvCacheReuse(kv_cache_manager, snapshots, spatial_merge_size, scratch_slots)
