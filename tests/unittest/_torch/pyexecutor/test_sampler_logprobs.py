"""Sampler logprobs: log_softmax of the raw logits, ranks and top-k, packed with the tokens.

Only the rows that ask get a payload, a step where none asks hands back the token tensor itself
(nothing packed, nothing computed), and the packed copy splits back exactly.
"""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.request_lifecycle import apply_new_tokens
from tensorrt_llm._torch.pyexecutor.sampler import TorchSampler
from tensorrt_llm._torch.pyexecutor.sampler_logprobs import unpack
from tensorrt_llm.sampling_params import MAX_LOGPROBS, SamplingParams

V = 50


def _req(rid: int, **kwargs) -> LlmRequest:
    req = LlmRequest(rid, [1, 2, 3], SamplingParams(**kwargs))
    req.context_chunk_size = 3
    return req


def _mixed_batch() -> list[LlmRequest]:
    return [
        _req(0, temperature=0.0, logprobs=3),
        _req(1, temperature=0.0),  # no logprobs: no payload row
        _req(2, temperature=1.0, seed=7, logprobs=0),
        _req(3, temperature=0.8, top_k=5, seed=1, logprobs=5, repetition_penalty=1.5),
    ]


def test_step_without_logprobs_is_the_plain_token_tensor() -> None:
    sampler = TorchSampler(V, "cpu")
    step = sampler.sample_step(torch.randn(2, V), [_req(0), _req(1, temperature=0.0)])
    assert step.layout is None and step.packed is step.tokens
    tokens, logprobs = sampler.step_to_host(step)
    assert tokens == step.tokens.tolist() and logprobs is None


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_k() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, V + 2)
    logits[:, V:] = 50.0  # padded lm_head columns never count
    reqs = _mixed_batch()
    sampler = TorchSampler(V, "cpu")
    step = sampler.sample_step(logits, reqs)
    assert step.layout is not None and step.layout.rows == (0, 2, 3)
    tokens, entries = sampler.step_to_host(step)
    assert tokens == step.tokens.tolist()
    assert entries is not None and entries[1] is None
    want = torch.log_softmax(logits[:, :V], dim=-1)  # raw: before penalty and temperature
    for row, k in ((0, 3), (2, 0), (3, 5)):
        entry = entries[row]
        assert entry is not None
        tok = tokens[row]
        assert entry.logprob == pytest.approx(want[row, tok].item(), abs=1e-6)
        assert entry.rank == int((want[row] > want[row, tok]).sum()) + 1
        top_lp, top_ids = want[row].topk(k)
        assert list(entry.top_ids) == top_ids.tolist()
        assert entry.top_logprobs == pytest.approx(top_lp.tolist(), abs=1e-6)
        assert list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
    assert entries[0] is not None and entries[0].rank == 1  # greedy: the most likely token


def test_sampled_token_outside_top_k_has_its_own_rank() -> None:
    logits = torch.zeros(1, V)
    logits[0, :10] = torch.arange(10, 0, -1).float()  # token 0 most likely, ..., 9
    logits[0, 20] = -5.0
    req = _req(0, temperature=0.0, logprobs=2, logit_bias={20: 100.0})  # forces token 20
    sampler = TorchSampler(V, "cpu")
    tokens, entries = sampler.step_to_host(sampler.sample_step(logits, [req]))
    assert tokens == [20] and entries is not None and entries[0] is not None
    want = torch.log_softmax(logits[0], dim=-1)
    assert entries[0].logprob == pytest.approx(want[20].item(), abs=1e-6)  # raw, not biased
    assert entries[0].rank == V  # the least likely of all
    assert list(entries[0].top_ids) == [0, 1]


def test_packed_copy_round_trips_special_floats() -> None:
    logits = torch.full((1, V), float("-inf"))
    logits[0, 3] = 0.0  # every other token has probability 0: logprob -inf
    req = _req(0, temperature=0.0, logprobs=2)
    sampler = TorchSampler(V, "cpu")
    step = sampler.sample_step(logits, [req])
    tokens, entries = unpack(step.packed.clone(), step.layout)
    assert tokens == [3] and entries is not None and entries[0] is not None
    assert entries[0].logprob == 0.0 and entries[0].top_ids[0] == 3
    assert entries[0].top_logprobs[1] == float("-inf")


def test_entries_follow_their_tokens_into_the_request() -> None:
    torch.manual_seed(3)
    reqs = _mixed_batch()
    sampler = TorchSampler(V, "cpu")
    for _ in range(3):
        tokens, entries = sampler.step_to_host(sampler.sample_step(torch.randn(4, V), reqs))
        apply_new_tokens(reqs, tokens, logprobs=entries)
    assert [len(r.output_logprobs) for r in reqs] == [3, 0, 3, 3]
    assert reqs[1].logprobs_tail(2) is None
    assert reqs[0].logprobs_tail(2) == reqs[0].output_logprobs[1:]


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 1.5, True])
def test_logprobs_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)  # type: ignore[arg-type]
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == MAX_LOGPROBS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logprob_step_does_not_sync_on_cuda() -> None:
    reqs = _mixed_batch()
    sampler = TorchSampler(V, "cuda")
    logits = torch.randn(4, V, device="cuda")
    sampler.sample_step(logits, reqs)  # warm-up: generators, allocator growth
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = sampler.sample_step(logits, reqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, entries = sampler.step_to_host(step)
    assert len(tokens) == 4 and entries is not None and entries[1] is None
