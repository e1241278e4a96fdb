"""Logit processors of the sampler against HF's processors / the plain definitions (CPU).

One batch mixes settings (some rows use none); the device history is driven step by step like
the sampler drives it, including tokens the host never saw (the overlap scheduler's case).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.sampler import TorchSampler
from tensorrt_llm._torch.pyexecutor.sampler_penalties import LogitProcessors
from tensorrt_llm.sampling_params import SamplingParams

V = 32
CPU = torch.device("cpu")
END = 1


class WordTokenizer:
    """encode() from a table, so the bad-word token sequences are known exactly."""

    eos_token_id = END
    pad_token_id = None
    TABLE = {
        "ab": [2, 3],
        " ab": [12, 3],  # same length, another first token: banned too (vLLM's rule)
        "cde": [4, 5, 6],
        " cde": [14, 5],  # another length: not banned
        "x": [7],
        " x": [7],  # the same sequence: not added twice
    }

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return list(self.TABLE[text])


def _params(**kwargs: Any) -> SamplingParams:
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("end_id", END)
    return SamplingParams(**kwargs).with_tokenizer(WordTokenizer())


def _req(rid: int, prompt: list[int], **kwargs: Any) -> LlmRequest:
    req = LlmRequest(rid, prompt, _params(**kwargs))
    req.context_chunk_size = len(prompt)
    return req


# Rows of the mixed batch: (prompt, output, params). Outputs all have 4 tokens.
ROWS: list[tuple[list[int], list[int], dict[str, Any]]] = [
    ([3, 4, 5], [8, 9, 8, 10], {}),
    ([3, 4, 5], [8, 9, 8, 10], {"repetition_penalty": 1.7}),
    ([3, 4, 5], [8, 9, 8, 8], {"presence_penalty": 0.5, "frequency_penalty": 0.75}),
    ([6, 7], [2, 2, 2, 2], {"logit_bias": {5: 2.5, 9: -3.0, 31: 0.25}}),
    ([6, 7], [2, 9, 4, 5], {"bad_words": ["ab", "cde", "x"]}),
    ([6, 7], [9, 4, 5, 2], {"min_tokens": 5, "stop_token_ids": [2, 30]}),  # one more to go
    ([6, 7], [9, 4, 5, 2], {"min_tokens": 4, "stop_token_ids": [2]}),  # may stop now
    (
        [11, 3, 11],
        [12, 3, 4, 12],
        {
            "logit_bias": {3: 1.0, 20: -0.5},
            "bad_words": ["ab", "cde"],
            "min_tokens": 9,
            "repetition_penalty": 0.6,
            "presence_penalty": -0.4,
            "frequency_penalty": 0.3,
        },
    ),
    ([9], [20, 21, 20, 22], {"temperature": 0.0}),
]


def _reference(logits: torch.Tensor, req: LlmRequest) -> torch.Tensor:
    """HF's processors (and the OpenAI/vLLM definition of presence/frequency) on one row."""
    p = req.sampling_params
    x = logits.clone().unsqueeze(0)
    full = torch.tensor([req.prompt_token_ids + req.output_token_ids])
    output = torch.tensor([req.output_token_ids], dtype=torch.long)
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])(full, x)
    if p.bad_words_token_ids:
        words = [list(seq) for seq in p.bad_words_token_ids]
        x = NoBadWordsLogitsProcessor(words)(output, x)  # vLLM: the output only
    if p.min_tokens:
        stops = [p.end_id, *p.stop_token_set]
        x = MinNewTokensLengthLogitsProcessor(req.prompt_len, p.min_tokens, stops)(full, x)
    if p.repetition_penalty != 1:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(full, x)
    counts = torch.bincount(output[0], minlength=V).float()
    return (x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float())[0]


def _replay(reqs: list[LlmRequest], outputs: list[list[int]], proc: LogitProcessors) -> None:
    """Give each request its output one token per step, recorded the way the sampler does."""
    for step in range(len(outputs[0])):
        dev = proc.history.device  # the sampler hands over logits on the history's device
        _, update = proc.apply(torch.zeros(len(reqs), V, device=dev), reqs)
        tokens = torch.tensor([out[step] for out in outputs], device=dev)
        if update is not None:
            proc.record(update, tokens)
        for req, tok in zip(reqs, tokens.tolist(), strict=True):
            req.add_new_token(tok)


def _mixed_batch() -> list[LlmRequest]:
    return [_req(i, prompt, **kw) for i, (prompt, _, kw) in enumerate(ROWS)]


def test_bad_words_are_tokenized_like_vllm() -> None:
    sp = _params(bad_words=["ab", "cde", " x"])
    assert sp.bad_words_token_ids == ((2, 3), (12, 3), (4, 5, 6), (7,))
    # replace keeps the ids (child params, max_tokens fits); changing the words drops them.
    assert replace(sp, max_tokens=3).bad_words_token_ids == sp.bad_words_token_ids
    changed = replace(sp, bad_words=["x"])
    assert changed.bad_words_token_ids is None
    assert changed.with_tokenizer(WordTokenizer()).bad_words_token_ids == ((7,),)
    with pytest.raises(ValueError, match="need a tokenizer"):
        SamplingParams(bad_words=["ab"]).with_tokenizer(None)


def test_mixed_batch_matches_hf_processors() -> None:
    reqs = _mixed_batch()
    proc = LogitProcessors(V, CPU)
    _replay(reqs, [out for _, out, _ in ROWS], proc)
    torch.manual_seed(0)
    logits = torch.randn(len(reqs), V) * 3
    got, update = proc.apply(logits.to(torch.bfloat16), reqs)
    assert update is not None and got.dtype == torch.float32
    for row, req in enumerate(reqs):
        want = _reference(logits.to(torch.bfloat16).float()[row], req)
        torch.testing.assert_close(got[row], want, msg=f"row {row}: {ROWS[row][2]}")
    assert torch.equal(got[0], logits.to(torch.bfloat16).float()[0])  # no feature: untouched
    # The cases the batch is built to hit, so a no-op processor cannot pass.
    assert got[4, 7] == -torch.inf  # "x": one token, always banned
    assert got[4, 6] == -torch.inf and got[4, 3] != -torch.inf  # ends with 4, 5 (not 2)
    assert got[7, 3] == -torch.inf  # ends with 12: " ab" bans 3 despite its logit_bias
    assert got[5, 2] == -torch.inf and got[5, END] == -torch.inf and got[6, 2] != -torch.inf


def test_greedy_and_seeded_sampling_use_the_processed_logits() -> None:
    """Sampling with the processors equals plain sampling of the reference-processed logits,
    step after step (the same seeds give the same draws)."""
    sampled = [
        _req(0, [3, 4], temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0),
        _req(1, [3, 4], temperature=0.8, seed=7, frequency_penalty=2.0, logit_bias={9: 1.0}),
        _req(2, [5], temperature=0.9, top_p=0.9, seed=8, bad_words=["ab"], min_tokens=3),
        _req(3, [5], temperature=0.7, seed=9),  # nothing to process
        _req(4, [5], temperature=1.1, seed=10, min_p=0.05, presence_penalty=2.0),
    ]
    plain = [
        _req(r.request_id, r.prompt_token_ids, **_sampling_only(r.sampling_params)) for r in sampled
    ]
    a, b = TorchSampler(V, "cpu"), TorchSampler(V, "cpu")
    torch.manual_seed(1)
    base = torch.randn(len(sampled), V)
    for _ in range(8):
        logits = base + 0.1 * torch.randn_like(base)
        want = torch.stack([_reference(logits[i], r) for i, r in enumerate(sampled)])
        got_a = a.sample(logits, sampled).tolist()
        got_b = b.sample(want, plain).tolist()
        assert got_a == got_b
        for req, twin, tok in zip(sampled, plain, got_a, strict=True):
            req.add_new_token(tok)
            twin.add_new_token(tok)
    out0 = sampled[0].output_token_ids
    assert len(set(out0)) == len(out0)  # greedy with a presence penalty 1.0 never repeats


def _sampling_only(p: SamplingParams) -> dict[str, Any]:
    return {"temperature": p.temperature, "top_p": p.top_p, "seed": p.seed, "min_p": p.min_p}


def test_min_p_matches_hf_after_temperature() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, V) * 2
    params = [_params(temperature=0.5, min_p=m) for m in (0.0, 0.05, 0.3, 1.0)]
    got = TorchSampler._min_p_filtered(logits / 0.5, params)
    for row, p in enumerate(params):
        want = logits[row : row + 1] / 0.5
        if p.min_p > 0:
            want = MinPLogitsWarper(p.min_p)(None, want)  # type: ignore[arg-type]
        assert torch.equal(got[row].isinf(), want[0].isinf()), row
    assert int((~got[3].isinf()).sum()) == 1 and not got[0].isinf().any()


def test_history_follows_device_tokens_the_host_never_saw() -> None:
    """Overlap scheduler: tokens stay in flight (not on the host), the counts still see them."""
    req = _req(0, [30, 31, 30], temperature=0.0, presence_penalty=2.0, repetition_penalty=1.1)
    sampler = TorchSampler(V, "cpu")
    logits = torch.linspace(1.0, 0.0, V).unsqueeze(0)  # token 0 best; spread < the penalty
    tokens = []
    for _ in range(5):
        tokens.append(int(sampler.sample(logits, [req])[0]))
        req.add_in_flight_token()
    assert tokens == [0, 1, 2, 3, 4] and req.output_token_ids == []
    history = sampler._processors.history
    assert history.codes is not None
    want = 2 * torch.bincount(torch.tensor(tokens), minlength=V).int()
    want[[30, 31]] += 1  # the prompt bit (repetition penalty)
    assert torch.equal(history.codes[0], want)
    sampler.release(req.request_id)
    assert history.codes is None and history.num_tracked == 0  # nothing held any more


def test_min_tokens_counts_tokens_in_flight() -> None:
    req = _req(0, [3], temperature=0.0, min_tokens=2, stop_token_ids=[5])
    sampler = TorchSampler(V, "cpu")
    logits = torch.zeros(1, V)
    logits[0, END], logits[0, 5], logits[0, 9] = 3.0, 2.0, 1.0
    tokens = []
    for _ in range(3):
        tokens.append(int(sampler.sample(logits, [req])[0]))
        req.add_in_flight_token()  # the host never learns the value (overlap scheduler)
    assert tokens == [9, 9, END]
    ignoring = _req(1, [3], temperature=0.0, min_tokens=2, ignore_eos=True)
    assert int(sampler.sample(logits, [ignoring])[0]) == END  # END does not stop it: allowed


def test_min_tokens_yields_where_only_stopping_is_left() -> None:
    # Row 0: a grammar (its mask already applied) allows only END and 5; min_tokens would
    # ban both, leaving nothing: they come back. Row 1: 9 is still allowed, so the ban holds.
    # Row 2: the only allowed token is a bad word: it stays banned (no yield for bad words).
    only_stop = torch.full((V,), float("-inf"))
    only_stop[END], only_stop[5] = 1.0, 2.0
    open_row = only_stop.clone()
    open_row[9] = 0.5
    bad_only = torch.full((V,), float("-inf"))
    bad_only[7] = 1.0
    reqs = [
        _req(0, [3], min_tokens=4, stop_token_ids=[5]),
        _req(1, [3], min_tokens=4, stop_token_ids=[5]),
        _req(2, [3], min_tokens=4, bad_words=["x"]),
    ]
    out, _ = LogitProcessors(V, CPU).apply(torch.stack([only_stop, open_row, bad_only]), reqs)
    assert torch.equal(out[0], only_stop)
    assert out[1, 9] == 0.5 and torch.isneginf(out[1, [END, 5]]).all()
    assert torch.isneginf(out[2]).all()


def test_rows_grow_keep_counts_and_reset_on_reuse() -> None:
    proc = LogitProcessors(V, CPU)
    reqs = [_req(i, [i + 1], frequency_penalty=1.0) for i in range(12)]
    _replay(reqs[:5], [[i, i] for i in range(5)], proc)
    assert proc.history.capacity == 8
    _replay(reqs, [[20, 21]] * 12, proc)  # 12 rows: the buffers grow to 16
    codes = proc.history.codes
    assert proc.history.capacity == 16 and codes is not None
    rows = proc.history.rows(reqs)
    assert len(set(rows)) == 12
    for i in range(5):  # counts from before the growth survive it
        assert codes[rows[i], i] == 4 and codes[rows[i], 20] == 2
    assert codes[rows[7], 7] == 0 and codes[rows[7], 21] == 2
    proc.release(3)
    fresh = _req(99, [5], frequency_penalty=1.0)
    assert proc.history.rows([fresh]) == [rows[3]]
    assert proc.history.codes is not None and not proc.history.codes[rows[3]].any()


def test_multi_token_bad_words_widen_the_tail() -> None:
    proc = LogitProcessors(V, CPU)
    short = _req(0, [1], bad_words=["ab"])
    _replay([short], [[2]], proc)
    assert proc.history.tail_len == 1
    longer = _req(1, [1], bad_words=["cde"])
    _replay([short, longer], [[9, 2], [4, 5]], proc)  # outputs 2, 9, 2 and 4, 5
    assert proc.history.tail_len == 2
    out, _ = proc.apply(torch.zeros(2, V), [short, longer])
    assert out[0, 3] == -torch.inf and out[1, 6] == -torch.inf  # 2 -> 3 and 4, 5 -> 6
    assert out[0, 6] == 0 and out[1, 3] == 0


def test_requests_without_processors_take_the_plain_path(monkeypatch) -> None:
    def boom(*_: Any) -> Any:
        raise AssertionError("the processors ran for requests that use none")

    monkeypatch.setattr(LogitProcessors, "apply", boom)
    sampler = TorchSampler(V, "cpu")
    reqs = [
        _req(0, [1], temperature=0.0),
        _req(1, [1], temperature=0.7, top_p=0.9, seed=3),
        _req(2, [1], temperature=0.0, min_p=0.5),  # min_p is a sampling-stage filter
        _req(3, [1], min_tokens=0, logit_bias={}, bad_words=[]),
        _req(4, [1], min_tokens=2, temperature=0.0),
    ]
    reqs[4].add_new_token(5)
    reqs[4].add_in_flight_token()  # min_tokens reached (one of them still in flight)
    sampler.sample(torch.randn(5, V), reqs)
    assert sampler._processors.history.codes is None


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1.0}, "min_tokens"),
        ({"min_tokens": 40, "max_tokens": 8}, "must not exceed max_tokens"),
        ({"logit_bias": [(1, 2.0)]}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias key"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias key"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\]"),
        ({"bad_words": "ab"}, "bad_words"),
        ({"bad_words": ["ab", " "]}, "bad_words"),
        ({"bad_words": [3]}, "bad_words"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict[str, Any], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocab_are_named() -> None:
    assert _params(logit_bias={5: 1.0}).why_not_in_vocab(V) is None
    assert "logit_bias" in (_params(logit_bias={V: 1.0}).why_not_in_vocab(V) or "")
    assert "bad_words" in (_params(bad_words=["cde"]).why_not_in_vocab(5) or "")
    # A stop id past the vocab can never be sampled: the request would silently never stop.
    assert _params(stop_token_ids=[V - 1]).why_not_in_vocab(V) is None
    assert _params(stop_token_ids=[V + 3]).vocab_problem(V) == (
        "stop_token_ids",
        f"stop_token_ids names token ids [{V + 3}] outside the vocab [0, {V})",
    )
    untokenized = SamplingParams(bad_words=["ab"])
    assert "never tokenized" in (untokenized.why_not_in_vocab(V) or "")
    assert TorchSampler(V, "cpu").why_invalid(LlmRequest(0, [1], untokenized)) is not None


@pytest.mark.gpu
def test_cuda_matches_cpu_and_does_not_sync() -> None:
    outputs = [out for _, out, _ in ROWS]
    cpu, cuda = LogitProcessors(V, CPU), LogitProcessors(V, torch.device("cuda"))
    cpu_reqs, reqs = _mixed_batch(), _mixed_batch()
    _replay(cpu_reqs, outputs, cpu)
    _replay(reqs, outputs, cuda)
    logits = torch.randn(len(reqs), V)
    want, _ = cpu.apply(logits, cpu_reqs)
    got, _ = cuda.apply(logits.cuda(), reqs)
    torch.testing.assert_close(got.cpu(), want)
    sampler = TorchSampler(V, "cuda")
    step = [*reqs, _req(50, [3, 4], temperature=0.8, seed=1, repetition_penalty=1.2)]
    dev_logits = torch.randn(len(step), V, device="cuda")
    sampler.sample(dev_logits[:-1], reqs)  # warm-up: generators, allocator growth
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # a new tracked request (row reset from its prompt) and the steady state
        tokens = sampler.sample(dev_logits, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(0 <= t < V for t in sampler.to_host(tokens))
