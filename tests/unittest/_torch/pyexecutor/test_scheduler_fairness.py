"""SimpleScheduler fair admission: scheduling groups take turns round-robin (issue 13).

Pure Python: the real scheduler, KV and slot managers, requests played by `_finish_step`.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import _finish_step, _sched

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduler import SimpleScheduler
from tensorrt_llm.sampling_params import SamplingParams


def _req(rid: int, group: Hashable | None, prompt_len: int = 2, max_tokens: int = 2) -> LlmRequest:
    return LlmRequest(
        rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), scheduling_group=group
    )


def _admission_order(s: SimpleScheduler, reqs: list[LlmRequest], steps: int = 500) -> list[int]:
    """Play steps until every request finished; the ids in the order they were admitted."""
    order: list[int] = []
    for _ in range(steps):
        active = [r for r in reqs if not r.is_finished]
        if not active:
            return order
        out = s.schedule(active)
        order += [r.request_id for r in out.context_requests if r.is_first_context_chunk]
        _finish_step(s, out)
    raise AssertionError("workload did not finish")


def _round_robin(groups: list[list[int]]) -> list[int]:
    """Reference: take one from each non-empty group in turn, oldest group first."""
    queues = [list(g) for g in groups]
    out: list[int] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def test_a_later_client_is_not_stuck_behind_a_big_one() -> None:
    s = _sched(max_batch_size=4, max_num_tokens=100, slots=4)
    big = [_req(i, "big") for i in range(40)]
    late = _req(100, "late")
    out = s.schedule([*big, late])
    # Strict FCFS would admit big 0..3 and leave the later client waiting 10 rounds.
    assert [r.request_id for r in out.context_requests] == [0, 100, 1, 2]


def test_groups_take_turns_one_admission_per_step() -> None:
    # The token budget fits one 4-token prompt per step (generation rows take one each).
    s = _sched(max_batch_size=8, max_num_tokens=5, slots=8)
    a = [_req(i, "a", prompt_len=4) for i in range(5)]
    b = [_req(10 + i, "b", prompt_len=4) for i in range(5)]
    c = [_req(20, "c", prompt_len=4)]
    order = _admission_order(s, [*a, *b, *c])
    assert order == _round_robin([[r.request_id for r in g] for g in (a, b, c)])


def test_default_groups_keep_fcfs() -> None:
    s = _sched(max_batch_size=2, max_num_tokens=100, slots=2)
    reqs = [_req(i, None) for i in range(7)]
    assert _admission_order(s, reqs) == list(range(7))


def test_new_group_joins_at_the_back_of_the_rotation() -> None:
    s = _sched(max_batch_size=8, max_num_tokens=5, slots=8)
    a = [_req(i, "a", prompt_len=4) for i in range(3)]
    b = [_req(10 + i, "b", prompt_len=4) for i in range(3)]
    reqs = [*a, *b]
    out = s.schedule(reqs)
    assert [r.request_id for r in out.context_requests] == [0]  # a's turn; a goes to the back
    _finish_step(s, out)
    newcomer = _req(30, "new", prompt_len=4)
    reqs.append(newcomer)
    order = [r.request_id for r in s.schedule(reqs).context_requests]
    assert order == [10]  # b was waiting in the rotation before the newcomer joined


def test_long_prompt_is_not_starved_by_a_stream_of_short_ones() -> None:
    # No chunking: the long prompt needs the whole budget, so running short requests keep it
    # out until it reaches the head of the order; then it blocks new admissions and runs.
    s = _sched(max_batch_size=4, max_num_tokens=10, slots=4, num_blocks=256)
    long_req = _req(999, "long", prompt_len=10)
    reqs: list[LlmRequest] = [_req(0, "short"), long_req]
    next_id = 1
    for step in range(40):
        reqs += [_req(next_id, "short"), _req(next_id + 1, "short")]  # a steady stream
        next_id += 2
        active = [r for r in reqs if not r.is_finished]
        out = s.schedule(active)
        if long_req in out.context_requests:
            assert step < 10
            return
        _finish_step(s, out)
    pytest.fail("the long prompt was never admitted")


def test_scheduling_group_must_be_hashable() -> None:
    with pytest.raises(TypeError, match="scheduling_group must be hashable"):
        _req(0, ["not", "hashable"])  # type: ignore[arg-type]
    req = _req(1, None)
    with pytest.raises(TypeError, match="scheduling_group"):
        req.scheduling_group = {"a": 1}  # type: ignore[assignment]
    assert req.scheduling_key != _req(2, None).scheduling_key  # own group per request
    assert _req(3, 7).scheduling_key == _req(4, 7).scheduling_key


@settings(max_examples=40, deadline=None)
@given(
    work=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=12),
    max_batch_size=st.integers(1, 4),
    max_num_tokens=st.integers(1, 16),
    chunked=st.booleans(),
)
def test_random_grouped_workload_completes(
    work: list[tuple[int, int]], max_batch_size: int, max_num_tokens: int, chunked: bool
) -> None:
    if not chunked:
        work = [(min(n, max_num_tokens), g) for n, g in work]
    s = _sched(max_batch_size, max_num_tokens, chunked, num_blocks=20, tpb=4, max_blocks=8)
    reqs = [_req(i, g, prompt_len=n, max_tokens=3) for i, (n, g) in enumerate(work)]
    assert all(s.validate(r) is None for r in reqs)
    order = _admission_order(s, reqs)
    assert sorted(order) == list(range(len(reqs)))
    for group in {g for _, g in work}:  # FCFS inside each group
        ids = [r.request_id for r in reqs if r.scheduling_group == group]
        assert [i for i in order if i in ids] == ids
    assert s.kv_cache_manager.num_free_blocks == 20 and s.seq_slot_manager.num_free == max(
        max_batch_size, 1
    )
