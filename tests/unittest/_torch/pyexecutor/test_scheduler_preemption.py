"""SimpleScheduler with KV on demand: blocks as sequences grow, preemption by recompute (victims
by priority, then latest arrival), the decode-first token budget, requests that never fit, and
no deadlock with a tiny pool."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm._torch.pyexecutor.llm_request import ERROR_PROMPT_TOO_LONG, LlmRequest
from tensorrt_llm._torch.pyexecutor.request_lifecycle import apply_step_results, sample_rows
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests, SimpleScheduler
from tensorrt_llm.sampling_params import SamplingParams

TPB = 4


def _sched(
    num_blocks: int, max_batch_size: int = 4, max_num_tokens: int = 64, watermark: int = 0
) -> SimpleScheduler:
    kv = KVCacheManager(1, 1, 4, TPB, num_blocks, 64, torch.float32, "cpu")
    slots = SeqSlotManager(max_batch_size)
    return SimpleScheduler(max_batch_size, max_num_tokens, True, kv, slots, watermark)


def _req(rid: int, prompt_len: int, max_tokens: int = 8, priority: int = 0) -> LlmRequest:
    params = SamplingParams(max_tokens=max_tokens, priority=priority)
    return LlmRequest(rid, list(range(1, prompt_len + 1)), params)


def _step(s: SimpleScheduler, reqs: list[LlmRequest], token: int = 7) -> ScheduledRequests:
    """One step as the executor runs it (every sampled row gets `token`); frees the finished."""
    out = s.schedule(reqs)
    everyone = out.all_requests
    produced = [everyone[i] for i in sample_rows(out)]
    apply_step_results(out, produced, [token] * len(produced))
    for req in produced + out.failed:
        if req.is_finished:
            s.release_resources(req)
    return out


def _blocks(s: SimpleScheduler, req: LlmRequest) -> int:
    return len(s.kv_cache_manager.get_block_ids(req.request_id))


def test_blocks_grow_with_the_sequence() -> None:
    s = _sched(num_blocks=16)
    req = _req(0, 6, max_tokens=8)
    _step(s, [req])
    # Admission: the prompt (6) plus the look-ahead token = 7 tokens = 2 blocks, not 14.
    assert _blocks(s, req) == 2 and req.num_tokens == 7
    while not req.is_finished:
        before = req.num_tokens  # this step writes position before - 1, claims one spare
        _step(s, [req])
        if not req.is_finished:
            assert _blocks(s, req) == -(-(before + 1) // TPB)
    assert req.num_tokens == 14
    assert req.is_finished and s.kv_cache_manager.num_free_blocks == 16


def test_decodes_take_the_budget_first() -> None:
    s = _sched(num_blocks=64, max_num_tokens=6)
    reqs = [_req(i, 2) for i in range(3)]
    _step(s, reqs)
    reqs.append(_req(3, 10))
    out = s.schedule(reqs)
    assert [r.request_id for r in out.generation_requests] == [0, 1, 2]
    assert [(r.request_id, r.context_chunk_size) for r in out.context_requests] == [(3, 3)]


def _fill(s: SimpleScheduler, reqs: list[LlmRequest]) -> None:
    """Admit and prefill all of `reqs` (each takes 1 block: prompt 3 + 1 spare)."""
    out = _step(s, reqs)
    assert len(out.context_requests) == len(reqs) and all(r.is_generation for r in reqs)


def test_victim_is_lowest_priority_then_latest_arrival() -> None:
    # 4 blocks, 4 requests of 1 block each: the next step needs a second block for everyone.
    s = _sched(num_blocks=4)
    reqs = [_req(0, 3, priority=1), _req(1, 3), _req(2, 3, priority=1), _req(3, 3)]
    _fill(s, reqs)
    out = s.schedule(reqs)
    # Priority 1 goes first (lower runs first), the later of the two (2) before 0.
    assert [r.request_id for r in out.preempted] == [2, 0]
    assert [r.request_id for r in out.generation_requests] == [1, 3]
    victim = reqs[2]
    assert victim.is_context_init and victim.seq_slot is None and victim.is_preempted
    assert s.kv_cache_manager.get_block_ids(2) == [] and s.num_preemptions == 2


def test_preempted_request_resumes_with_its_outputs_as_context() -> None:
    s = _sched(num_blocks=4)
    reqs = [_req(i, 3, max_tokens=3) for i in range(4)]
    _fill(s, reqs)
    _step(s, reqs, token=9)
    last = reqs[3]
    assert last.is_preempted and last.output_token_ids == [7]
    assert last.context_len == 4 and list(last.context_token_array) == [1, 2, 3, 7]
    # The waiting order puts it ahead of a request that arrived later.
    newcomer = _req(4, 3)
    for _ in range(20):
        active = [r for r in reqs + [newcomer] if not r.is_finished]
        if not active:
            break
        out = _step(s, active)
        if last in out.context_requests:
            assert newcomer.seq_slot is None or newcomer in out.context_requests
    assert all(r.is_finished for r in reqs + [newcomer])
    # Resumed: its next token was sampled after recomputing [1, 2, 3, 7], then one decode.
    assert len(last.output_token_ids) == 3 and last.num_preemptions >= 1


def test_waiting_queue_orders_by_priority() -> None:
    s = _sched(num_blocks=64, max_batch_size=1)
    reqs = [_req(0, 3), _req(1, 3, priority=-1)]
    out = s.schedule(reqs)
    assert [r.request_id for r in out.context_requests] == [1]


def test_in_flight_victim_defers_preemption() -> None:
    s = _sched(num_blocks=2)
    reqs = [_req(0, 3), _req(1, 3)]
    _fill(s, reqs)
    for req in reqs:
        req.add_in_flight_token()  # the overlap executor launched a step for both
    out = s.schedule(reqs)
    # Request 0 needs request 1's block, but 1's last token is still on the device.
    assert out.preemption_deferred and not out.preempted and out.is_empty
    for req in reqs:
        req.resolve_in_flight_token(7)
    out = s.schedule(reqs)  # after the sync the victim can go
    assert [r.request_id for r in out.preempted] == [1] and not out.preemption_deferred
    assert [r.request_id for r in out.generation_requests] == [0]


def test_request_too_large_for_the_pool_fails_alone() -> None:
    s = _sched(num_blocks=4)
    big = _req(0, 12, max_tokens=8)  # 20 tokens > 16 in the pool
    assert "KV blocks" in (s.validate(big) or "")
    small = _req(1, 3, max_tokens=2)
    for _ in range(20):  # scheduled without validation: it fails at runtime, never hangs
        active = [r for r in (big, small) if not r.is_finished]
        if not active:
            break
        _step(s, active)
    assert big.finish_reason == "error" and big.error_code == ERROR_PROMPT_TOO_LONG
    assert "kv_cache_config.max_tokens" in (big.error or "")
    assert small.finish_reason == "length"
    assert s.kv_cache_manager.num_free_blocks == 4


def test_prompt_larger_than_the_pool_fails_at_admission() -> None:
    s = _sched(num_blocks=2, max_num_tokens=64)
    big = _req(0, 20, max_tokens=1)
    out = s.schedule([big])
    assert out.failed == [big] and big.finish_reason == "error"


@settings(max_examples=60, deadline=None)
@given(
    work=st.lists(
        st.tuples(st.integers(1, 14), st.integers(1, 10), st.integers(-1, 1)),
        min_size=1,
        max_size=8,
    ),
    max_batch_size=st.integers(1, 4),
    max_num_tokens=st.integers(1, 16),
    spare_blocks=st.integers(0, 3),
)
def test_tiny_pool_finishes_everything(
    work: list[tuple[int, int, int]], max_batch_size: int, max_num_tokens: int, spare_blocks: int
) -> None:
    need = max(-(-(p + m) // TPB) for p, m, _ in work)
    s = _sched(need + spare_blocks, max_batch_size, max_num_tokens, watermark=1)
    reqs = [_req(i, p, m, prio) for i, (p, m, prio) in enumerate(work)]
    assert all(s.validate(r) is None for r in reqs)
    bound = 50 * sum(p + m for p, m, _ in work)
    for _ in range(bound):
        active = [r for r in reqs if not r.is_finished]
        if not active:
            break
        out = _step(s, active)
        assert not out.is_empty, "deadlock: active requests but nothing scheduled"
        assert out.batch_size <= max_batch_size and out.num_tokens <= max_num_tokens
        kv = s.kv_cache_manager
        held = sum(_blocks(s, r) for r in reqs)
        assert held + kv.num_free_blocks == kv.num_blocks
    assert all(r.finish_reason == "length" for r in reqs)
    assert all(r.output_token_ids == [7] * r.sampling_params.max_tokens for r in reqs)
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
