"""Continuous-batching scheduler: which requests run this step, how many tokens each, and
which running requests give their KV blocks back (preemption by recompute).

Policy:
- Importance: lower `priority` first (vLLM's convention, default 0), then arrival (the
  executor's FCFS accept order). It orders the running requests and picks preemption victims.
- Generation requests go first, most important first; each costs one token of the
  `max_num_tokens` budget. Context chunks share what is left: first the prompts already
  admitted (part-way through chunked prefill or a recompute), then the waiting ones.
- KV on demand: blocks are claimed as a sequence grows, never reserved ahead. A step claims
  what it writes plus `KV_LOOKAHEAD_TOKENS` spare token: the overlap executor launches the next
  step before this one's token is on the host (and once past a stop), and that write must
  land in a block the request owns. Admitting a waiting request needs its first chunk's blocks
  and must leave `watermark_blocks` free (unless nothing runs), so that running requests
  rarely preempt right after an admission.
- Preemption: when a running request cannot get the block it needs, the least important
  running request not scheduled yet this step (latest arrival among the lowest priority; it
  may be the request itself) is preempted: its KV blocks and seq slot (so the recurrent
  state rows of hybrid models too) are freed and it waits again, at the front of the waiting
  order, its generated tokens folded into the context to recompute (`LlmRequest.preempt`). A
  request with a token still in flight (overlap executor) cannot be recomputed yet: the
  scheduler then marks the step `preemption_deferred` and the executor syncs and schedules
  again. A request that is the only one holding KV and still cannot get a block fails with
  an error (submission normally rejects it first: `validate`). Waiting requests never preempt
  running ones, whatever their priority; priority orders the waiting queue only.
- Fair order of the waiting queue: waiting requests belong to scheduling groups
  (`LlmRequest.scheduling_group`, e.g. all prompts x n of one client call; default: a group
  per request). Groups take turns round-robin: a rotation keeps them oldest first, a group
  that gets a request admitted goes to the back, a new group joins at the back. Within a step
  the order interleaves the groups (the first waiting request of each group in rotation
  order, then the second of each, ...); inside a group it is FCFS. That order is then stably
  sorted by priority, preempted requests ahead of new ones of equal priority.
- No starvation: the first waiting request (in that order) that cannot start blocks the ones
  behind it, and its group keeps its place at the head of the rotation. A step that had to
  preempt admits nothing new. The most important running request always gets its blocks
  (everything less important gives way), so every request finishes.
- Prefix reuse (`reuse`, a `KvCacheReuse`; None: off): a waiting request is matched against
  the cached blocks before its first chunk is sized, so the chunk and the admission check
  count only what the hit leaves to compute; the hit blocks become its first blocks (a hit
  that would not fit takes no reference). A resume after preemption is matched again.
  Hybrid models (`HybridKvCacheReuse`) snapshot the recurrent state inside a chunk: once the
  step is sized `reuse.plan_step` gives those requests a free seq slot as scratch (with none
  free the chunk ends at the point); a chunk holding two points ends at the second
  (`reuse.chunk_limit`); they hear of every release (`reuse.on_released`).
- Reservation (`guaranteed_no_evict`, scheduler_config GUARANTEED_NO_EVICT): a waiting
  request is admitted only when the blocks of its whole prompt + max_tokens fit in the pool
  beside the same reservation of every request holding KV; nothing is ever preempted then
  (TensorRT-LLM's default policy; ours is on demand).
- Chunking: with `enable_chunked_prefill` (the default) the head context takes whatever
  budget is left; without it a prompt runs whole or waits. A recompute always may chunk: its
  prompt + outputs may exceed `max_num_tokens` even when the prompt alone did not.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field

from .kv_cache_reuse import KvCacheReuse
from .llm_request import ERROR_PROMPT_TOO_LONG, LlmRequest
from .resource_manager import KVCacheManager, SeqSlotManager

# Spare KV token beyond a step's last write (see the module policy: the overlap look-ahead).
KV_LOOKAHEAD_TOKENS = 1
# Share of the pool a new admission must leave free (at least one block), vLLM's 1%.
WATERMARK_FRACTION = 0.01
# The knobs that size the KV pool, for error messages.
KV_POOL_KNOBS = (
    "kv_cache_config.max_tokens (kv_cache_max_tokens) or kv_cache_free_gpu_memory_fraction"
)


@dataclass
class ScheduledRequests:
    """One step's work. The engine packs context requests first, then generation requests."""

    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    # Sent back to waiting this step (their blocks are free already).
    preempted: list[LlmRequest] = field(default_factory=list)
    # Can never get their blocks (error set, resources freed): the executor finishes them.
    failed: list[LlmRequest] = field(default_factory=list)
    # A victim was needed but had a token in flight: sync the pending step, schedule again.
    preemption_deferred: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def num_context_tokens(self) -> int:
        return sum(req.context_chunk_size for req in self.context_requests)

    @property
    def num_tokens(self) -> int:
        return self.num_context_tokens + len(self.generation_requests)

    @property
    def is_empty(self) -> bool:
        return self.batch_size == 0

    @property
    def all_requests(self) -> list[LlmRequest]:
        """Requests in batch order (context first)."""
        return self.context_requests + self.generation_requests


def _interleave(queues: list[list[LlmRequest]]) -> Iterator[LlmRequest]:
    """The first item of each queue, then the second of each, ..."""
    for rank in range(max((len(q) for q in queues), default=0)):
        for queue in queues:
            if rank < len(queue):
                yield queue[rank]


def kv_tokens_for_chunk(request: LlmRequest, chunk: int, spec_tokens: int = 0) -> int:
    """KV tokens a context request owns once `chunk` more of its context is prefilled: the
    look-ahead token (plus `spec_tokens`, the drafts' writes) only when the chunk ends the
    context (the step then samples)."""
    end = request.context_current_position + chunk
    spare = KV_LOOKAHEAD_TOKENS + spec_tokens if end >= request.context_len else 0
    return min(end + spare, request.max_num_tokens)


def kv_tokens_for_generation(request: LlmRequest, spec_tokens: int = 0) -> int:
    """KV tokens a generation step needs: its input token's write plus the look-ahead, plus
    `spec_tokens` for speculative decoding (verified drafts and the next drafts' writes)."""
    return min(request.num_tokens + KV_LOOKAHEAD_TOKENS + spec_tokens, request.max_num_tokens)


class SimpleScheduler:
    def __init__(
        self,
        max_batch_size: int,
        max_num_tokens: int,
        enable_chunked_prefill: bool,
        kv_cache_manager: KVCacheManager,
        seq_slot_manager: SeqSlotManager,
        watermark_blocks: int | None = None,
        reuse: KvCacheReuse | None = None,
        guaranteed_no_evict: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.kv_cache_manager = kv_cache_manager
        self.seq_slot_manager = seq_slot_manager
        if watermark_blocks is None:
            watermark_blocks = max(1, int(kv_cache_manager.num_blocks * WATERMARK_FRACTION))
        self.watermark_blocks = watermark_blocks
        self.reuse = reuse
        self.guaranteed_no_evict = guaranteed_no_evict
        self.num_preemptions = 0  # over the scheduler's life (metrics)
        # Speculative decoding (`set_draft_len`): step tokens and extra KV per generation row.
        self.tokens_per_generation = 1
        self.spec_kv_tokens = 0
        # Groups with waiting requests, in turn order (see the module policy).
        self._rotation: OrderedDict[Hashable, None] = OrderedDict()

    def set_draft_len(self, num_draft_tokens: int) -> None:
        """Speculative decoding: a generation row runs 1 + k tokens, and its KV claim covers
        the verified drafts plus the MTP head's writes for the next k drafts (2k spare)."""
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        if 1 + num_draft_tokens > self.max_num_tokens:
            raise ValueError(
                f"max_num_tokens={self.max_num_tokens} cannot hold one generation row of "
                f"1 + {num_draft_tokens} draft tokens"
            )
        self.tokens_per_generation = 1 + num_draft_tokens
        self.spec_kv_tokens = 2 * num_draft_tokens

    def validate(self, request: LlmRequest) -> str | None:
        """Why the request can never be scheduled (None when it can). Checked at submission."""
        kv = self.kv_cache_manager
        if not self.enable_chunked_prefill and request.prompt_len > self.max_num_tokens:
            return (
                f"prompt of {request.prompt_len} tokens exceeds max_num_tokens="
                f"{self.max_num_tokens}; enable chunked prefill or raise max_num_tokens"
            )
        need = request.max_num_tokens
        if need > kv.max_tokens_per_seq:
            return (
                f"prompt ({request.prompt_len}) + max_tokens ({request.sampling_params.max_tokens})"
                f" = {need} tokens exceeds the per-sequence KV limit of {kv.max_tokens_per_seq}"
            )
        # NOTE: the whole pool for one request is the bound that keeps preemption live: the
        # most important request can always grow to its end once the others gave way.
        if kv.blocks_for_tokens(need) > kv.num_blocks:
            return (
                f"prompt ({request.prompt_len}) + max_tokens ({request.sampling_params.max_tokens})"
                f" = {need} tokens needs {kv.blocks_for_tokens(need)} KV blocks of "
                f"{kv.tokens_per_block} tokens but the whole cache only has {kv.num_blocks} "
                f"({kv.num_blocks * kv.tokens_per_block} tokens); lower max_tokens or raise "
                f"{KV_POOL_KNOBS}"
            )
        return None

    def schedule(self, active_requests: Iterable[LlmRequest]) -> ScheduledRequests:
        """Pick this step's requests; sets `context_chunk_size`, claims KV blocks and seq slots,
        and preempts when the pool runs out (module docstring)."""
        requests = [req for req in active_requests if not req.is_finished]
        rank = {id(req): i for i, req in enumerate(requests)}
        # Holders of KV, most important first; victims come off the end.
        running = sorted(
            (req for req in requests if req.seq_slot is not None),
            key=lambda r: (r.priority, rank[id(r)]),
        )
        scheduled = ScheduledRequests()
        budget = self.max_num_tokens
        for req in running:
            if not req.is_generation or req.num_sampled_tokens >= req.sampling_params.max_tokens:
                # NOTE: with the overlap scheduler a request's last token may be sampled but
                # not yet on the host: nothing is left to decode, it waits for that token.
                continue
            if scheduled.batch_size >= self.max_batch_size or budget < self.tokens_per_generation:
                break
            need = kv_tokens_for_generation(req, self.spec_kv_tokens)
            if self._grow(req, need, running, scheduled, may_self=True):
                scheduled.generation_requests.append(req)
                budget -= self.tokens_per_generation
        self._schedule_contexts(requests, running, scheduled, budget)
        if self.reuse is not None:
            self.reuse.plan_step(scheduled, self.seq_slot_manager)
        return scheduled

    def _schedule_contexts(
        self,
        requests: list[LlmRequest],
        running: list[LlmRequest],
        scheduled: ScheduledRequests,
        budget: int,
    ) -> None:
        served: list[Hashable] = []
        kv = self.kv_cache_manager
        # GUARANTEED_NO_EVICT: blocks promised to the holders' whole sequences (O(running) once).
        reserved = (
            sum(kv.blocks_for_tokens(r.max_num_tokens) for r in running)
            if self.guaranteed_no_evict
            else 0
        )
        for req in self._context_order(requests, running):
            if scheduled.batch_size >= self.max_batch_size:
                break
            waiting = req.seq_slot is None
            if waiting and (scheduled.preempted or scheduled.preemption_deferred):
                break  # short of blocks this step: admit nothing new
            whole = kv.blocks_for_tokens(req.max_num_tokens) if self.guaranteed_no_evict else 0
            if waiting and reserved + whole > kv.num_blocks:
                break  # the head waits for reservations to end (no starvation)
            hit = self._match(req) if waiting else []
            chunk = self._context_chunk(req, budget)
            if chunk == 0:
                self._unmatch(req)
                break  # the head blocks the rest: no starvation (module docstring)
            need = kv_tokens_for_chunk(req, chunk, self.spec_kv_tokens)
            if not waiting:
                if not self._grow(req, need, running, scheduled, may_self=False):
                    break
            else:
                if not self._admit(req, need, hit):
                    self._unmatch(req)
                    if not self.kv_cache_manager.num_used_blocks and self.seq_slot_manager.num_free:
                        self._fail(req, need, scheduled)  # an empty cache cannot hold it
                        continue
                    break
                served.append(req.scheduling_key)
                reserved += whole
            req.context_chunk_size = chunk
            scheduled.context_requests.append(req)
            budget -= chunk
        for group in served:  # their turn is used: to the back of the rotation
            if group in self._rotation:
                self._rotation.move_to_end(group)

    def _context_order(
        self, requests: list[LlmRequest], running: list[LlmRequest]
    ) -> Iterator[LlmRequest]:
        """Context requests in admission order: admitted ones (by importance), then the waiting
        ones interleaved over the groups in rotation order and sorted by priority (preempted
        first within a priority). Clears every stale chunk size first."""
        waiting: dict[Hashable, list[LlmRequest]] = {}
        for req in requests:
            if not req.is_context_init:
                continue
            req.context_chunk_size = 0  # stale values from a previous step must not leak
            if req.seq_slot is None:
                waiting.setdefault(req.scheduling_key, []).append(req)
        admitted = [r for r in running if r.is_context_init and r.seq_slot is not None]
        for group in [g for g in self._rotation if g not in waiting]:
            del self._rotation[group]
        for group in waiting:  # dict order = FCFS order of each new group's first request
            if group not in self._rotation:
                self._rotation[group] = None
        queues = [waiting[group] for group in self._rotation]
        fair: Iterable[LlmRequest] = _interleave(queues)
        # NOTE: sorted only when some waiting request needs it: the common all-default case
        # stays lazy (admission usually stops after a few of thousands waiting).
        if any(r.priority or r.num_preemptions for q in queues for r in q):
            fair = sorted(fair, key=lambda r: (r.priority, not r.is_preempted))
        return itertools.chain(admitted, fair)

    def _context_chunk(self, req: LlmRequest, budget: int) -> int:
        remaining = req.context_remaining_length
        if self.reuse is not None:  # hybrid models: at most one snapshot point inside
            remaining = self.reuse.chunk_limit(req, remaining)
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill or req.num_preemptions else 0

    def _match(self, req: LlmRequest) -> list[int]:
        """A waiting request's cached prefix; its context provisionally starts after it, so
        the chunk is sized on what is left (`_unmatch` undoes it when it is not admitted)."""
        if self.reuse is None:
            return []
        hit = self.reuse.match(req)
        req.context_current_position = req.kv_start_position = (
            len(hit) * self.kv_cache_manager.tokens_per_block
        )
        return hit

    @staticmethod
    def _unmatch(req: LlmRequest) -> None:
        if req.seq_slot is None:
            req.context_current_position = req.kv_start_position = 0

    def _admit(self, req: LlmRequest, need: int, hit: list[int]) -> bool:
        """Give a waiting request a seq slot, its cached prefix `hit` and its first chunk's
        blocks, leaving the watermark free unless nothing else holds KV."""
        kv = self.kv_cache_manager
        if self.seq_slot_manager.num_free == 0:
            return False
        extra = kv.blocks_for_tokens(need) - len(hit)
        reserve = self.watermark_blocks if kv.num_used_blocks else 0
        # Evictable hit blocks stop being free once taken: count what is left after that.
        if extra + reserve > kv.free_blocks_after_hit(hit):
            return False
        if hit:
            kv.add_cached_prefix(req.request_id, hit)
        if not kv.ensure_capacity(req.request_id, need):
            kv.free(req.request_id)
            return False
        req.seq_slot = self.seq_slot_manager.acquire(req.request_id)
        if self.reuse is not None:
            self.reuse.on_admitted(req, hit)
        return True

    def _grow(
        self,
        req: LlmRequest,
        need: int,
        running: list[LlmRequest],
        scheduled: ScheduledRequests,
        may_self: bool,
    ) -> bool:
        """Claim `need` tokens of KV for a running request, preempting less important running
        requests not scheduled yet while the pool is short. `may_self`: the request may be its
        own victim (generation); otherwise it just waits. False: not scheduled this step."""
        kv = self.kv_cache_manager
        taken: set[int] | None = None  # built on the first shortage only: O(batch) per call
        while not kv.ensure_capacity(req.request_id, need):
            if taken is None:
                taken = {id(r) for r in scheduled.all_requests}
            victims = [r for r in running if r.seq_slot is not None and id(r) not in taken]
            victim = victims[-1] if victims else req
            if victim is req and not may_self:
                if len(victims) <= 1 and not taken:
                    self._fail(req, need, scheduled)
                return False
            if victim.num_in_flight_tokens:
                scheduled.preemption_deferred = True
                return False
            if victim is req and len(victims) <= 1 and not taken:
                self._fail(req, need, scheduled)  # alone and still short: it never fits
                return False
            self._preempt(victim, scheduled)
            if victim is req:
                return False
        return True

    def _preempt(self, req: LlmRequest, scheduled: ScheduledRequests) -> None:
        self.release_resources(req)
        req.preempt()
        self.num_preemptions += 1
        scheduled.preempted.append(req)

    def _fail(self, req: LlmRequest, need: int, scheduled: ScheduledRequests) -> None:
        kv = self.kv_cache_manager
        have = len(kv.get_block_ids(req.request_id))
        req.set_error(
            f"request needs {need} tokens of KV ({kv.blocks_for_tokens(need)} blocks of "
            f"{kv.tokens_per_block}) but only {have + kv.num_free_blocks} of the cache's "
            f"{kv.num_blocks} blocks can be given to it even running alone; lower max_tokens or "
            f"raise {KV_POOL_KNOBS}",
            ERROR_PROMPT_TOO_LONG,
        )
        self.release_resources(req)
        scheduled.failed.append(req)

    def release_resources(self, request: LlmRequest) -> None:
        """Free a finished (cancelled, failed, preempted) request's KV blocks and seq slot."""
        self.kv_cache_manager.free(request.request_id)
        self.seq_slot_manager.release(request.request_id)
        request.seq_slot = None
        if self.reuse is not None:
            self.reuse.on_released(request)
