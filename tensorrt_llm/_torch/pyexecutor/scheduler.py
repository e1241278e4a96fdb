"""Continuous-batching scheduler: which requests run this step and how many tokens each.
The KV side (claims, admission, preemption by recompute, prefix reuse) is `KvAdmissionMixin`
(kv_admission.py, whose docstring holds that part of the policy); the step's result is
`ScheduledRequests` (scheduled_requests.py).

Policy:
- Importance: lower `priority` first (vLLM's convention, default 0), then arrival (the
  executor's FCFS accept order). It orders the running requests and picks preemption victims.
- Generation requests go first, most important first; each costs one token of the
  `max_num_tokens` budget. Context chunks share what is left: first the prompts already
  admitted (part-way through chunked prefill or a recompute), then the waiting ones.
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

from .kv_admission import (
    KV_POOL_KNOBS,
    WATERMARK_FRACTION,
    KvAdmissionMixin,
    kv_tokens_for_chunk,
    kv_tokens_for_generation,
)
from .kv_cache_reuse import KvCacheReuse
from .llm_request import LlmRequest
from .resource_manager import KVCacheManager, SeqSlotManager
from .scheduled_requests import ScheduledRequests

__all__ = ["ScheduledRequests", "SimpleScheduler"]


def _interleave(queues: list[list[LlmRequest]]) -> Iterator[LlmRequest]:
    """The first item of each queue, then the second of each, ..."""
    for rank in range(max((len(q) for q in queues), default=0)):
        for queue in queues:
            if rank < len(queue):
                yield queue[rank]


class SimpleScheduler(KvAdmissionMixin):
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
        and preempts when the pool runs out (kv_admission.py's docstring)."""
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
            self.reuse.plan_step(scheduled)
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
