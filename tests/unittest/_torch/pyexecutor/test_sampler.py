"""TorchSampler: greedy/top-k/top-p/seeded sampling on the device."""

from __future__ import annotations

import math

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampler import TorchSampler
from tensorrt_llm.sampling_params import SamplingParams

V = 64


def _ctx_req(rid: int, **kwargs) -> LlmRequest:
    req = LlmRequest(rid, [1, 2, 3], SamplingParams(**kwargs))
    req.context_chunk_size = 3
    return req


def test_greedy_is_argmax_and_padded_vocab_is_ignored() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, V + 3)
    logits[:, V:] = 100.0  # padded lm_head columns must never win
    reqs = [_ctx_req(i, temperature=0.0) for i in range(5)]
    tokens = TorchSampler(V, "cpu").sample(logits, reqs)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits[:, :V].argmax(-1))


def test_top_k_one_equals_greedy_in_a_mixed_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    reqs = [_ctx_req(i, temperature=0.9, top_k=1) for i in range(3)]
    reqs += [_ctx_req(3, temperature=0.0), _ctx_req(4, temperature=1.5), _ctx_req(5, top_p=0.5)]
    tokens = TorchSampler(V, "cpu").sample(logits, reqs)
    assert torch.equal(tokens[:4], logits[:4].argmax(-1))


def test_sample_rejects_mismatched_shapes() -> None:
    sampler = TorchSampler(V, "cpu")
    with pytest.raises(ValueError, match="num_requests"):
        sampler.sample(torch.zeros(2, V), [_ctx_req(0)])
    with pytest.raises(ValueError, match="vocab_size"):
        sampler.sample(torch.zeros(1, V - 1), [_ctx_req(0)])


def _seeded_run(companions: list[LlmRequest], row: int, steps: int = 6) -> list[int]:
    """Tokens of request 100 (seed 1234) when sampled at `row` among `companions`."""
    sampler = TorchSampler(V, "cpu")
    target = _ctx_req(100, temperature=1.0, top_p=0.95, seed=1234)
    flat = torch.zeros(V)  # uniform: every draw depends only on the random stream
    out = []
    for _ in range(steps):
        reqs = list(companions)
        reqs.insert(row, target)
        logits = torch.randn(len(reqs), V)  # companions' rows are noise
        logits[row] = flat
        out.append(int(sampler.sample(logits, reqs)[row]))
    return out


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    torch.manual_seed(2)
    alone = _seeded_run([], 0)
    assert alone == _seeded_run([], 0)
    companions = [
        _ctx_req(1, temperature=0.7),
        _ctx_req(2, temperature=1.0, seed=1234),  # same seed, other request: own stream
        _ctx_req(3, temperature=0.0),
    ]
    assert _seeded_run(companions, 2) == alone
    torch.manual_seed(99)  # the global RNG must not matter for a seeded request
    assert _seeded_run(companions[:1], 1) == alone
    assert len(set(alone)) > 1, "a uniform distribution should not repeat one token"


def _sample_many(probs: list[float], n: int, **kwargs) -> torch.Tensor:
    """n draws from the distribution `probs` (shuffled into a 16-token vocab)."""
    torch.manual_seed(3)
    vocab = 16
    perm = torch.randperm(vocab)
    logits = torch.full((vocab,), float("-inf"))
    logits[perm[: len(probs)]] = torch.tensor(probs).log()
    reqs = [_ctx_req(i, **kwargs) for i in range(n)]
    tokens = TorchSampler(vocab, "cpu").sample(logits.expand(n, vocab).clone(), reqs)
    # Map back to the index into `probs`.
    inverse = torch.full((vocab,), -1, dtype=torch.int64)
    inverse[perm[: len(probs)]] = torch.arange(len(probs))
    return inverse[tokens]


def test_top_p_keeps_only_the_nucleus() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    idx = _sample_many(probs, 4000, temperature=1.0, top_p=0.7)
    # The nucleus for 0.7 is {0.5, 0.3}: 0.5 alone is short of 0.7, the next token reaches it.
    assert set(idx.tolist()) == {0, 1}
    frac = (idx == 0).float().mean().item()
    expected, sigma = 0.5 / 0.8, math.sqrt(0.625 * 0.375 / 4000)
    assert abs(frac - expected) < 5 * sigma


def test_top_k_and_plain_temperature_match_the_distribution() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    idx = _sample_many(probs, 4000, temperature=1.0, top_k=3)
    assert set(idx.tolist()) == {0, 1, 2}
    for i, p in enumerate(probs[:3]):
        frac = (idx == i).float().mean().item()
        assert abs(frac - p / 0.9) < 5 * math.sqrt(p / 0.9 * (1 - p / 0.9) / 4000)
    # Temperature 0.5 squares the odds: p_i^2 / sum p^2.
    idx = _sample_many(probs, 4000, temperature=0.5)
    norm = sum(p * p for p in probs)
    for i, p in enumerate(probs):
        frac = (idx == i).float().mean().item()
        q = p * p / norm
        assert abs(frac - q) < 5 * math.sqrt(q * (1 - q) / 4000) + 1e-3


def test_to_host_returns_python_ints() -> None:
    assert TorchSampler(V, "cpu").to_host(torch.tensor([3, 1, 4])) == [3, 1, 4]


@pytest.mark.gpu
def test_sample_does_not_sync_on_cuda() -> None:
    torch.manual_seed(4)
    sampler = TorchSampler(V, "cuda")
    reqs = [_ctx_req(0, temperature=0.0), _ctx_req(1, top_k=5, seed=7), _ctx_req(2, top_p=0.8)]
    logits = torch.randn(3, V, device="cuda")
    sampler.sample(logits, reqs)  # warm-up: generator creation, allocator growth
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sampler.sample(logits, reqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = sampler.to_host(tokens)
    assert host[0] == int(logits[0].argmax())
    assert all(0 <= t < V for t in host)


def test_seeded_tokens_do_not_depend_on_a_companions_filters() -> None:
    # A seeded row without top-k/top-p, alone and beside a row that takes the sorted
    # (filtered) path: the same tokens, step after step.
    torch.manual_seed(3)
    steps = [torch.randn(2, V) for _ in range(6)]
    alone, beside = TorchSampler(V, "cpu"), TorchSampler(V, "cpu")
    seeded = _ctx_req(0, temperature=1.0, seed=11)
    seeded_twin = _ctx_req(0, temperature=1.0, seed=11)
    filtered = _ctx_req(1, temperature=1.0, top_k=5, seed=5)
    a = [alone.sample(logits[:1], [seeded]).item() for logits in steps]
    b = [beside.sample(logits, [seeded_twin, filtered])[0].item() for logits in steps]
    assert a == b
