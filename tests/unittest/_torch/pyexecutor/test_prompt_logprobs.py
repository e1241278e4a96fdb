"""prompt_logprobs.py on its own: which step rows a chunk asks for and the tokens they predict,
the sliced LM head against one log_softmax over every row, and the packed copy's round trip
behind the tokens (and output logprobs) of the step."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.pyexecutor import prompt_logprobs as plp
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampler_logprobs import SampledStep, with_logprobs
from tensorrt_llm.sampling_params import SamplingParams

V = 11
HIDDEN = 6


def _req(rid: int, prompt: list[int], begin: int, size: int, k: int | None) -> LlmRequest:
    req = LlmRequest(rid, prompt, SamplingParams(prompt_logprobs=k, logprobs=k))
    req.context_current_position = begin
    req.context_chunk_size = size
    return req


def test_plan_rows_and_targets_per_chunk() -> None:
    first = _req(0, list(range(10, 20)), 0, 4, 2)  # first chunk: rows 0..3 -> tokens 1..4
    other = _req(1, [1, 2, 3], 0, 3, None)  # asks for none: rows 4..6 skipped
    last = _req(2, list(range(30, 36)), 3, 3, 0)  # last chunk [3, 6): rows 7, 8 -> tokens 4, 5
    plan = plp.plan_prompt_logprobs([first, other, last], torch.device("cpu"))
    assert plan is not None
    assert plan.rows.tolist() == [0, 1, 2, 3, 7, 8]
    assert plan.targets.tolist() == [11, 12, 13, 14, 34, 35]
    assert plan.layout.requests == (first, last) and plan.layout.counts == (4, 2)
    assert plan.layout.ks == (2, 0) and plan.layout.width == 2
    assert plp.plan_prompt_logprobs([other], torch.device("cpu")) is None
    one_token = _req(3, [5], 0, 1, 3)  # nothing to predict
    assert plp.plan_prompt_logprobs([one_token], torch.device("cpu")) is None


@pytest.mark.parametrize("slice_rows", [1, 2, 100])
def test_sliced_lm_head_matches_one_log_softmax(
    slice_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plp, "SLICE_BYTES", 4 * V * slice_rows)
    torch.manual_seed(0)
    head = torch.randn(V + 2, HIDDEN)  # padded vocab columns are never looked at
    hidden = torch.randn(9, HIDDEN)
    reqs = [_req(0, list(range(1, 8)), 0, 7, 3), _req(1, [4, 5, 6], 0, 2, 1)]
    plan = plp.plan_prompt_logprobs(reqs, torch.device("cpu"))
    assert plan is not None
    payload = plp.compute_prompt_logprobs(hidden, plan, lambda h: h @ head.T, V)
    tokens = torch.tensor([3, 4])
    step = plp.attach(with_logprobs(torch.randn(2, V), tokens, reqs), payload, plan.layout)
    got_tokens, out_lp, prompt = plp.split_step(step.packed.clone(), step)
    assert got_tokens == [3, 4] and out_lp is not None and out_lp[0] is not None
    assert prompt is not None and [r for r, _ in prompt] == reqs
    want = torch.log_softmax((hidden @ head.T)[:, :V], dim=-1)
    rows = plan.rows.tolist()
    entries = [e for _, chunk in prompt for e in chunk]
    assert [len(chunk) for _, chunk in prompt] == [6, 2]  # [0, 2) of 3 tokens: 2 entries
    ks = [3] * 6 + [1] * 2
    for entry, row, target, k in zip(entries, rows, plan.targets.tolist(), ks, strict=True):
        dist = want[row]
        assert entry.logprob == pytest.approx(dist[target].item(), abs=1e-6)
        assert entry.rank == int((dist > dist[target]).sum()) + 1
        top = dist.topk(k)
        assert list(entry.top_ids) == top.indices.tolist()
        assert list(entry.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-6)


def test_a_step_of_prompt_entries_alone() -> None:
    req = _req(0, [1, 2, 3, 4], 0, 2, 0)
    plan = plp.plan_prompt_logprobs([req], torch.device("cpu"))
    assert plan is not None
    payload = plp.compute_prompt_logprobs(torch.randn(2, HIDDEN), plan, lambda h: h[:, :V], V)
    empty = torch.empty(0, dtype=torch.int64)
    step = plp.attach(SampledStep(empty, empty, None), payload, plan.layout)
    tokens, out_lp, prompt = plp.split_step(step.packed, step)
    assert tokens == [] and out_lp is None
    assert prompt is not None and len(prompt[0][1]) == 2 and prompt[0][1][0].top_ids == ()
