"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Policy (kept deliberately simple):
- Generation requests go first: they already hold a seq slot and KV blocks, and each costs
  one token of the `max_num_tokens` budget.
- Context requests follow while the batch has room: first those already admitted (a prompt
  part-way through chunked prefill, FCFS), then the waiting ones in fair order. Without
  chunked prefill a prompt runs whole or waits; with it the head request takes whatever budget
  is left.
- Fair order: waiting requests belong to scheduling groups (`LlmRequest.scheduling_group`,
  e.g. all prompts x n of one client call; default: a group per request). Groups take turns
  round-robin: a rotation keeps them oldest first, a group that gets a request admitted goes
  to the back, a new group joins at the back. Within a step the order interleaves the
  groups (the first waiting request of each group in rotation order, then the second of
  each, ...); inside a group it is FCFS. With one request per group this is plain FCFS.
  So one call with 200 prompts x n=16 delays a later client by about one admission, not by
  3200 of them.
- No starvation: the first waiting request (in that order) that cannot start blocks the ones
  behind it, and its group keeps its place at the head of the rotation; a long prompt thus
  waits at most one turn of the rotation and then runs once resources free up.
- KV: a request reserves blocks for `prompt_len + max_tokens` tokens when it is admitted
  (its first chunk). Generation therefore never runs out of blocks and nothing is ever
  preempted; the price is memory held for tokens a request may not generate. The one spare
  token beyond the last KV write lets an overlapping executor run one step past a stop.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field

from .llm_request import LlmRequest
from .resource_manager import KVCacheManager, SeqSlotManager


@dataclass
class ScheduledRequests:
    """One step's work. The engine packs context requests first, then generation requests."""

    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)

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


def kv_reservation_tokens(request: LlmRequest) -> int:
    """Tokens of KV a request reserves at admission (see the module policy)."""
    return request.max_num_tokens


class SimpleScheduler:
    def __init__(
        self,
        max_batch_size: int,
        max_num_tokens: int,
        enable_chunked_prefill: bool,
        kv_cache_manager: KVCacheManager,
        seq_slot_manager: SeqSlotManager,
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
        # Groups with waiting requests, in turn order (see the module policy).
        self._rotation: OrderedDict[Hashable, None] = OrderedDict()

    def validate(self, request: LlmRequest) -> str | None:
        """Why the request can never be scheduled (None when it can). Checked at submission."""
        kv = self.kv_cache_manager
        if not self.enable_chunked_prefill and request.prompt_len > self.max_num_tokens:
            return (
                f"prompt of {request.prompt_len} tokens exceeds max_num_tokens="
                f"{self.max_num_tokens}; enable chunked prefill or raise max_num_tokens"
            )
        need = kv_reservation_tokens(request)
        if need > kv.max_tokens_per_seq:
            return (
                f"prompt ({request.prompt_len}) + max_tokens ({request.sampling_params.max_tokens})"
                f" = {need} tokens exceeds the per-sequence KV limit of {kv.max_tokens_per_seq}"
            )
        if kv.blocks_for_tokens(need) > kv.num_blocks:
            return (
                f"prompt + max_tokens = {need} tokens needs {kv.blocks_for_tokens(need)} KV blocks"
                f" but the cache only has {kv.num_blocks}"
            )
        return None

    def schedule(self, active_requests: Iterable[LlmRequest]) -> ScheduledRequests:
        """Pick this step's requests; sets `context_chunk_size` and acquires resources."""
        requests = [req for req in active_requests if not req.is_finished]
        scheduled = ScheduledRequests()
        budget = self.max_num_tokens
        for req in requests:
            # NOTE: with the overlap scheduler a request's last token may be sampled but not
            # yet on the host: nothing is left to decode, it waits for that token.
            if not req.is_generation or req.num_sampled_tokens >= req.sampling_params.max_tokens:
                continue
            if scheduled.batch_size >= self.max_batch_size or budget < 1:
                break
            if not self._prepare_generation(req):
                continue
            scheduled.generation_requests.append(req)
            budget -= 1
        served: list[Hashable] = []
        for req in self._context_order(requests):
            if scheduled.batch_size >= self.max_batch_size:
                break
            chunk = self._context_chunk(req, budget)
            newly_admitted = req.seq_slot is None
            if chunk == 0 or not self._admit(req):
                break  # the head blocks the rest: no starvation (module docstring)
            req.context_chunk_size = chunk
            scheduled.context_requests.append(req)
            budget -= chunk
            if newly_admitted:
                served.append(req.scheduling_key)
        for group in served:  # their turn is used: to the back of the rotation
            if group in self._rotation:
                self._rotation.move_to_end(group)
        return scheduled

    def _context_order(self, requests: list[LlmRequest]) -> Iterator[LlmRequest]:
        """Context requests in admission order: admitted ones (FCFS), then the waiting ones
        interleaved over the groups in rotation order. Clears every stale chunk size first;
        the order itself is produced lazily (admission usually stops after a few)."""
        admitted: list[LlmRequest] = []
        waiting: dict[Hashable, list[LlmRequest]] = {}
        for req in requests:
            if not req.is_context_init:
                continue
            req.context_chunk_size = 0  # stale values from a previous step must not leak
            if req.seq_slot is not None:
                admitted.append(req)
            else:
                waiting.setdefault(req.scheduling_key, []).append(req)
        for group in [g for g in self._rotation if g not in waiting]:
            del self._rotation[group]
        for group in waiting:  # dict order = FCFS order of each new group's first request
            if group not in self._rotation:
                self._rotation[group] = None
        queues = [waiting[group] for group in self._rotation]
        return itertools.chain(admitted, _interleave(queues))

    def _context_chunk(self, req: LlmRequest, budget: int) -> int:
        remaining = req.context_remaining_length
        if remaining <= budget:
            return remaining
        return budget if self.enable_chunked_prefill else 0

    def _admit(self, req: LlmRequest) -> bool:
        """Give a context request its seq slot and KV reservation (no-op once admitted)."""
        kv = self.kv_cache_manager
        has_slot = self.seq_slot_manager.get_slot(req.request_id) is not None
        if not has_slot and self.seq_slot_manager.num_free == 0:
            return False
        if not kv.ensure_capacity(req.request_id, kv_reservation_tokens(req)):
            return False
        req.seq_slot = self.seq_slot_manager.acquire(req.request_id)
        return True

    def _prepare_generation(self, req: LlmRequest) -> bool:
        """A generation step writes the KV of its input token: position num_tokens - 1."""
        if req.seq_slot is None:
            req.seq_slot = self.seq_slot_manager.acquire(req.request_id)
        # NOTE: covered by the admission reservation, so this never allocates in practice; it
        # stays as the single place to grow KV should the reservation policy change.
        return self.kv_cache_manager.ensure_capacity(req.request_id, req.num_tokens)

    def release_resources(self, request: LlmRequest) -> None:
        """Free a finished (or cancelled / failed) request's KV blocks and seq slot."""
        self.kv_cache_manager.free(request.request_id)
        self.seq_slot_manager.release(request.request_id)
        request.seq_slot = None
