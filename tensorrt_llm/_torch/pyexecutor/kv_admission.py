"""The scheduler's KV claims: how many KV tokens a step claims, admitting a waiting request
into the pool, growing a running one, and preemption by recompute when the pool runs out.
`SimpleScheduler` (scheduler.py) mixes `KvAdmissionMixin` in; the step's selection is there.

Policy:
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
- Prefix reuse (`reuse`, a `KvCacheReuse`; None: off): a waiting request is matched against
  the cached blocks before its first chunk is sized, so the chunk and the admission check
  count only what the hit leaves to compute; the hit blocks become its first blocks (a hit
  that would not fit takes no reference). A resume after preemption is matched again.
  Hybrid models (`HybridKvCacheReuse`) snapshot the recurrent state inside a chunk: once the
  step is sized `reuse.plan_step` gives those requests a scratch seq slot of its own (with
  none free the chunk ends at the point); a chunk holding two points ends at the second
  (`reuse.chunk_limit`); they hear of every release (`reuse.on_released`).
"""

from __future__ import annotations

from .kv_cache_reuse import KvCacheReuse
from .llm_request import ERROR_PROMPT_TOO_LONG, LlmRequest
from .resource_manager import KVCacheManager, SeqSlotManager
from .scheduled_requests import ScheduledRequests

# Spare KV token beyond a step's last write (see the module policy: the overlap look-ahead).
KV_LOOKAHEAD_TOKENS = 1
# Share of the pool a new admission must leave free (at least one block), vLLM's 1%.
WATERMARK_FRACTION = 0.01
# The knobs that size the KV pool, for error messages.
KV_POOL_KNOBS = (
    "kv_cache_config.max_tokens (kv_cache_max_tokens) or kv_cache_free_gpu_memory_fraction"
)


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


class KvAdmissionMixin:
    """KV claims of `SimpleScheduler`: admission, growth with preemption, failure, release."""

    # Set by SimpleScheduler.__init__.
    kv_cache_manager: KVCacheManager
    seq_slot_manager: SeqSlotManager
    watermark_blocks: int
    reuse: KvCacheReuse | None
    num_preemptions: int

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
