"""SimpleScheduler with KV block reuse, without a model: the hit at admission, the chunk sized
after it, registration of prompt and generated blocks, eviction, and a preempted request's
blocks staying cached for its resume."""

from __future__ import annotations

import torch

from tensorrt_llm._torch.pyexecutor.kv_cache_reuse import KvCacheReuse
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.request_lifecycle import apply_step_results, sample_rows
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests, SimpleScheduler
from tensorrt_llm.sampling_params import SamplingParams

TPB = 4


def _sched(num_blocks: int, max_num_tokens: int = 64) -> SimpleScheduler:
    kv = KVCacheManager(1, 1, 4, TPB, num_blocks, 64, torch.float32, "cpu", True)
    return SimpleScheduler(
        4, max_num_tokens, True, kv, SeqSlotManager(4), 0, reuse=KvCacheReuse(kv)
    )


def _req(rid: int, prompt: list[int], max_tokens: int = 6) -> LlmRequest:
    return LlmRequest(rid, prompt, SamplingParams(max_tokens=max_tokens))


def _step(s: SimpleScheduler, reqs: list[LlmRequest], token: int = 7) -> ScheduledRequests:
    """One step as the non-overlap executor runs it: schedule, register, apply, free."""
    out = s.schedule(reqs)
    assert s.reuse is not None
    s.reuse.register_step(out)
    everyone = out.all_requests
    produced = [everyone[i] for i in sample_rows(out)]
    apply_step_results(out, produced, [token] * len(produced))
    for req in produced + out.failed:
        if req.is_finished:
            s.release_resources(req)
    s.kv_cache_manager.pool.check_invariants()
    return out


def _run(s: SimpleScheduler, reqs: list[LlmRequest]) -> None:
    for _ in range(100):
        if all(r.is_finished for r in reqs):
            return
        _step(s, [r for r in reqs if not r.is_finished])
    raise AssertionError("requests did not finish")


PROMPT = list(range(1, 19))  # 18 tokens: 4 full blocks, at most 4 reusable


def test_repeat_starts_after_the_hit_and_sizes_its_chunk_on_the_rest() -> None:
    s = _sched(32)
    _run(s, [_req(0, PROMPT)])
    again = _req(1, PROMPT)
    out = s.schedule([again])
    assert again.num_cached_tokens == again.kv_start_position == 16
    assert out.context_requests == [again] and again.context_chunk_size == 2
    assert s.kv_cache_manager.prefix_cache_stats.hits == 16


def test_generated_blocks_are_registered_too() -> None:
    s = _sched(32)
    first = _req(0, PROMPT, max_tokens=8)
    _run(s, [first])
    # Prompt + outputs as the next turn's prompt: the outputs' full blocks hit as well (the
    # last output's KV was never written, so that block is not).
    follow = _req(1, first.all_token_ids + [99, 98, 97])
    s.schedule([follow])
    written = len(PROMPT) + len(first.output_token_ids) - 1
    assert follow.num_cached_tokens == written // TPB * TPB == 24


def test_a_miss_in_the_middle_stops_the_hit() -> None:
    s = _sched(32)
    _run(s, [_req(0, PROMPT)])
    changed = _req(1, PROMPT[:9] + [77] + PROMPT[10:])  # block 2 differs
    s.schedule([changed])
    assert changed.num_cached_tokens == 8


def test_eviction_reclaims_cached_blocks_least_recent_first() -> None:
    s = _sched(8)  # 32 tokens: one request of 18 + 6 at a time
    _run(s, [_req(0, PROMPT)])
    kv = s.kv_cache_manager
    assert kv.num_used_blocks == 0 and kv.pool.num_cached_blocks > 0
    _run(s, [_req(1, [100 + t for t in PROMPT])])  # needs the cached blocks back
    assert kv.prefix_cache_stats.evictions > 0
    late = _req(2, PROMPT)
    s.schedule([late])
    assert late.num_cached_tokens < 16


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    s = _sched(11, max_num_tokens=64)  # both admitted (5 blocks each), then short
    a, b = _req(0, PROMPT, max_tokens=12), _req(1, [50 + t for t in PROMPT], max_tokens=12)
    reqs = [a, b]
    preempted: list[LlmRequest] = []
    for _ in range(200):
        if all(r.is_finished for r in reqs):
            break
        out = _step(s, [r for r in reqs if not r.is_finished])
        preempted += out.preempted
        if preempted and preempted[0].seq_slot is not None and not preempted[0].is_finished:
            break  # the victim was admitted again
    assert preempted, "the pool must force a preemption"
    victim = preempted[0]
    # Its resume found the blocks it had registered before it was preempted.
    assert victim.kv_start_position > 0
    assert victim.num_cached_tokens == 0  # the report is the first admission's hit
    _run(s, reqs)
    assert all(len(r.output_token_ids) == 12 for r in reqs)
    assert s.kv_cache_manager.num_used_blocks == 0


def test_request_without_media_hashes_takes_no_part() -> None:
    from tensorrt_llm.inputs.multimodal import MultimodalParams, spans_data

    s = _sched(32)
    prompt = [1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8, 10]
    data = {"image": {"image_grid_thw": torch.tensor([[1, 4, 4]])}}
    data.update(spans_data({"image": ([4], [4])}))
    reqs = [
        LlmRequest(i, prompt, SamplingParams(max_tokens=2), MultimodalParams(dict(data)))
        for i in range(2)
    ]
    s.schedule(reqs[:1])
    assert reqs[0].block_reuse_off and reqs[0].block_keys == []
    assert s.reuse is not None
    assert s.reuse.match(reqs[1]) == []
