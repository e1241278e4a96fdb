"""SimpleScheduler's GUARANTEED_NO_EVICT policy (scheduler_config): admission reserves each
request's prompt + max_tokens blocks, so nothing is preempted and concurrency is capped by the
reservation; and the `SchedulerConfig` argument's checks."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.request_lifecycle import apply_step_results, sample_rows
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager
from tensorrt_llm._torch.pyexecutor.scheduler import SimpleScheduler
from tensorrt_llm.llmapi.scheduler_args import (
    CapacitySchedulerPolicy,
    SchedulerConfig,
    resolve_scheduler_config,
)
from tensorrt_llm.sampling_params import SamplingParams

TPB = 4


def _sched(num_blocks: int, guaranteed: bool) -> SimpleScheduler:
    kv = KVCacheManager(1, 1, 4, TPB, num_blocks, 64, torch.float32, "cpu")
    return SimpleScheduler(8, 64, True, kv, SeqSlotManager(8), 0, guaranteed_no_evict=guaranteed)


def _run(s: SimpleScheduler, reqs: list[LlmRequest]) -> tuple[int, int]:
    """Run all to the end; (peak of requests holding KV, preemptions)."""
    peak = 0
    for _ in range(500):
        if all(r.is_finished for r in reqs):
            return peak, s.num_preemptions
        out = s.schedule(reqs)
        peak = max(peak, sum(r.seq_slot is not None for r in reqs))
        rows = out.all_requests
        produced = [rows[i] for i in sample_rows(out)]
        apply_step_results(out, produced, [7] * len(produced))
        for req in produced:
            if req.is_finished:
                s.release_resources(req)
    raise AssertionError("did not finish")


def _reqs() -> list[LlmRequest]:
    # 4 requests of prompt 4 + max_tokens 12 = 16 tokens = 4 blocks each.
    return [LlmRequest(i, [1, 2, 3, 4], SamplingParams(max_tokens=12)) for i in range(4)]


@pytest.mark.parametrize("draft_len", [0, 3])
def test_reservation_caps_concurrency_and_never_preempts(draft_len: int) -> None:
    # 10 blocks: two whole reservations (8) fit, a third does not. With MTP drafts the spare
    # KV of a generation row is capped at prompt + max_tokens too, so the reservation holds.
    sched = _sched(10, guaranteed=True)
    sched.set_draft_len(draft_len)
    peak, preemptions = _run(sched, _reqs())
    assert (peak, preemptions) == (2, 0)


def test_on_demand_runs_more_at_once_and_preempts() -> None:
    # The same pool on demand admits all four (1 block each at first), then must preempt.
    peak, preemptions = _run(_sched(10, guaranteed=False), _reqs())
    assert peak == 4 and preemptions > 0


def test_scheduler_config_checks() -> None:
    assert resolve_scheduler_config(None).capacity_scheduler_policy is (
        CapacitySchedulerPolicy.MAX_UTILIZATION
    )
    cfg = resolve_scheduler_config({"capacity_scheduler_policy": "guaranteed_no_evict"})
    assert cfg.capacity_scheduler_policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    with pytest.raises(ValueError, match="STATIC_BATCH"):
        SchedulerConfig(capacity_scheduler_policy="STATIC_BATCH")
    with pytest.raises(ValueError, match="unknown scheduler_config field"):
        resolve_scheduler_config({"policy": "MAX_UTILIZATION"})
    with pytest.raises(ValueError, match="dynamic_batch_config"):
        SchedulerConfig(dynamic_batch_config={"enable_batch_size_tuning": True})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context_chunking_policy"):
        SchedulerConfig(context_chunking_policy="EQUAL_PROGRESS")


def test_llm_policies_give_the_same_tokens() -> None:
    """Through the LLM API on a tiny checkpoint and a small KV cache: the reservation policy
    reaches the engine (its scheduler never preempts) and greedy outputs equal on-demand's."""
    from tensorrt_llm import LLM
    from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

    ckpt = str(get_or_build_demo_checkpoint())
    prompts = [[5 + i, 9, 13, 17, 21, 25] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs, preemptions = [], []
    for policy in ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION"):
        llm = LLM(
            ckpt,
            device="cpu",
            executor_mode="inproc",
            max_batch_size=4,
            tokens_per_block=TPB,
            kv_cache_config={"max_tokens": 64, "enable_block_reuse": False},
            scheduler_config={"capacity_scheduler_policy": policy},
        )
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            outputs.append([list(o.outputs[0].token_ids) for o in outs])
            preemptions.append(llm._executor.scheduler.num_preemptions)
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]
    # 64 tokens = 16 blocks hold two reservations of 30 tokens (8 blocks): no preemption.
    assert preemptions[0] == 0 and preemptions[1] > 0
