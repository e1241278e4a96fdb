"""SimpleScheduler: batch/token limits, chunked prefill, FCFS, KV admission, validation."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.request_lifecycle import apply_step_results, sample_rows
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests, SimpleScheduler
from tensorrt_llm.sampling_params import SamplingParams


def _sched(
    max_batch_size: int = 4,
    max_num_tokens: int = 16,
    chunked: bool = False,
    num_blocks: int = 64,
    tpb: int = 4,
    max_blocks: int = 16,
    slots: int | None = None,
    watermark: int | None = None,
) -> SimpleScheduler:
    kv = KVCacheManager(1, 1, 4, tpb, num_blocks, max_blocks, torch.float32, "cpu")
    return SimpleScheduler(
        max_batch_size,
        max_num_tokens,
        chunked,
        kv,
        SeqSlotManager(slots or max_batch_size),
        watermark_blocks=watermark,
    )


def _req(rid: int, prompt_len: int, max_tokens: int = 4) -> LlmRequest:
    return LlmRequest(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


def _finish_step(s: SimpleScheduler, out: ScheduledRequests) -> None:
    """What the executor does after a forward (token 2 for every sampled row), then free the
    finished requests."""
    everyone = out.all_requests
    produced = [everyone[i] for i in sample_rows(out)]
    apply_step_results(out, produced, [2] * len(produced))
    for req in produced:
        if req.is_finished:
            s.release_resources(req)


def _run_step(s: SimpleScheduler, reqs: list[LlmRequest]) -> ScheduledRequests:
    out = s.schedule(reqs)
    _finish_step(s, out)
    return out


def test_scheduled_requests_properties() -> None:
    a, b, c = _req(0, 5), _req(1, 3), _req(2, 3)
    a.context_chunk_size = 5
    out = ScheduledRequests([a], [b, c])
    assert (out.batch_size, out.num_context_tokens, out.num_tokens) == (3, 5, 7)
    assert out.all_requests == [a, b, c] and not out.is_empty
    assert ScheduledRequests().is_empty


def test_max_batch_size_and_slots() -> None:
    s = _sched(max_batch_size=2, max_num_tokens=100)
    reqs = [_req(i, 3) for i in range(4)]
    out = s.schedule(reqs)
    assert [r.request_id for r in out.context_requests] == [0, 1]
    assert [r.seq_slot for r in out.context_requests] == [0, 1]
    assert reqs[2].seq_slot is None and reqs[2].context_chunk_size == 0


def test_token_budget_without_chunking_waits_fcfs() -> None:
    s = _sched(max_num_tokens=10)
    reqs = [_req(0, 6), _req(1, 6), _req(2, 2)]
    out = s.schedule(reqs)
    # Request 1 does not fit the 4 tokens left; strict FCFS keeps request 2 behind it.
    assert [r.request_id for r in out.context_requests] == [0]
    assert out.num_tokens == 6 and reqs[1].context_chunk_size == 0
    assert s.kv_cache_manager.get_block_ids(1) == []


def test_chunked_prefill_splits_prompt() -> None:
    s = _sched(max_num_tokens=8, chunked=True)
    reqs = [_req(0, 5), _req(1, 12)]
    out = s.schedule(reqs)
    assert [(r.request_id, r.context_chunk_size) for r in out.context_requests] == [(0, 5), (1, 3)]
    assert out.num_tokens == 8 and not reqs[1].is_last_context_chunk
    _finish_step(s, out)
    assert reqs[1].context_current_position == 3 and reqs[1].is_context_init
    out = s.schedule(reqs)
    assert [r.request_id for r in out.generation_requests] == [0]
    assert [(r.request_id, r.context_chunk_size) for r in out.context_requests] == [(1, 7)]
    assert out.num_tokens == 8
    _finish_step(s, out)
    out = s.schedule(reqs)
    assert reqs[1].context_chunk_size == 2 and reqs[1].is_last_context_chunk
    assert out.num_tokens == 1 + 2
    _finish_step(s, out)
    assert reqs[1].is_generation and reqs[1].context_current_position == 12


def test_generation_first_and_token_budget() -> None:
    s = _sched(max_batch_size=4, max_num_tokens=6)
    reqs = [_req(0, 3), _req(1, 3)]
    _run_step(s, reqs)
    reqs.append(_req(2, 5))
    out = s.schedule(reqs)
    assert [r.request_id for r in out.generation_requests] == [0, 1]
    assert out.context_requests == []  # 5 prompt tokens do not fit the 4 left
    assert out.num_tokens <= 6


def test_kv_admission_gates_and_release_frees() -> None:
    # 4 blocks of 4 tokens; admission claims prompt 6 + the look-ahead token = 2 blocks.
    s = _sched(max_num_tokens=100, num_blocks=4, watermark=0)
    reqs = [_req(i, 6, max_tokens=2) for i in range(3)]
    out = s.schedule(reqs)
    assert [r.request_id for r in out.context_requests] == [0, 1]
    assert s.kv_cache_manager.num_free_blocks == 0 and reqs[2].seq_slot is None
    reqs[0].finish("cancelled")
    s.release_resources(reqs[0])
    assert reqs[0].seq_slot is None and s.kv_cache_manager.num_free_blocks == 2
    for r in reqs[1:2]:
        r.move_to_next_context_chunk()
        r.add_new_token(2)
    out = s.schedule(reqs)
    assert [r.request_id for r in out.context_requests] == [2] and reqs[2].seq_slot == 0


def test_validate_reports_impossible_requests() -> None:
    s = _sched(max_num_tokens=8, num_blocks=6, tpb=4, max_blocks=16)
    assert s.validate(_req(0, 8)) is None
    assert "max_num_tokens" in s.validate(_req(1, 9))
    assert "KV blocks" in s.validate(_req(2, 4, max_tokens=30))
    chunked = _sched(max_num_tokens=8, chunked=True, num_blocks=64, tpb=4, max_blocks=4)
    assert chunked.validate(_req(3, 9, max_tokens=4)) is None
    assert "per-sequence" in chunked.validate(_req(4, 9, max_tokens=8))


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    max_batch_size=st.integers(1, 4),
    max_num_tokens=st.integers(1, 24),
)
def test_random_workload_completes_within_limits(
    prompts: list[int], max_batch_size: int, max_num_tokens: int
) -> None:
    s = _sched(max_batch_size, max_num_tokens, chunked=True, num_blocks=20, tpb=4, max_blocks=8)
    reqs = [_req(i, n, max_tokens=3) for i, n in enumerate(prompts)]
    assert all(s.validate(r) is None for r in reqs)
    admitted: list[int] = []
    for _ in range(500):
        active = [r for r in reqs if not r.is_finished]
        if not active:
            break
        out = s.schedule(active)
        assert not out.is_empty, "deadlock: active requests but nothing scheduled"
        assert out.batch_size <= max_batch_size and out.num_tokens <= max_num_tokens
        slots = [r.seq_slot for r in out.all_requests]
        assert None not in slots and len(set(slots)) == len(slots)
        admitted += [r.request_id for r in out.context_requests if r.request_id not in admitted]
        _finish_step(s, out)
    assert all(r.is_finished for r in reqs)
    assert admitted == sorted(admitted), "context admission must be FCFS"
    assert s.kv_cache_manager.num_free_blocks == 20
    assert s.seq_slot_manager.num_free == max_batch_size
