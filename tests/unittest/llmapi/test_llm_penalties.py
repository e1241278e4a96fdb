"""Penalties and logit processors end to end through `LLM` on a tiny random qwen2 (CPU).

min_tokens holds off an end id the model picks at once, a large logit_bias makes greedy output
its token, bad words ban the greedy word, the fields reach the engine untouched (also in process
mode), out-of-vocab ids fail for their request only, and generation_config.json's penalties
default the unset fields.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import ERROR_INVALID_INPUT, LlmRequest
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

KWARGS: dict[str, Any] = dict(
    device="cpu", max_batch_size=4, max_num_tokens=128, max_seq_len=128, tokens_per_block=16
)
PROMPT = "the quick brown fox"
GEN_CONFIG = {"repetition_penalty": 1.3, "presence_penalty": 0.5}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("penalties"))


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Any:
    with LLM(str(ckpt), executor_mode="inproc", **KWARGS) as engine:
        yield engine


def _greedy(llm: LLM, **params: Any) -> Any:
    params.setdefault("max_tokens", 6)
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, **params)).outputs[0]


def _received(llm: LLM) -> list[SamplingParams]:
    seen: list[SamplingParams] = []
    enqueue = llm._executor.enqueue_request

    def spy(request: Any, callback: Any = None) -> Any:
        seen.append(request.sampling_params)
        return enqueue(request, callback)

    llm._executor.enqueue_request = spy
    return seen


def test_min_tokens_prevents_an_early_end(llm: LLM) -> None:
    first = list(_greedy(llm, ignore_eos=True).token_ids)[0]
    early = _greedy(llm, end_id=first)
    assert list(early.token_ids) == [first] and early.finish_reason == "stop"
    held = list(_greedy(llm, end_id=first, min_tokens=3).token_ids)
    assert len(held) >= 3 and first not in held[:3]


def test_large_logit_bias_makes_greedy_output_that_token(llm: LLM) -> None:
    free = list(_greedy(llm, ignore_eos=True).token_ids)
    tok = next(t for t in range(5, 200) if t not in free)
    forced = _greedy(llm, ignore_eos=True, logit_bias={tok: 100.0})
    assert list(forced.token_ids) == [tok] * 6
    seeded = llm.generate(
        PROMPT, SamplingParams(max_tokens=4, seed=3, ignore_eos=True, logit_bias={tok: 100.0})
    ).outputs[0]
    assert list(seeded.token_ids) == [tok] * 4


def test_bad_words_ban_the_greedy_word(llm: LLM) -> None:
    free = list(_greedy(llm, ignore_eos=True).token_ids)
    word = llm.tokenizer.decode([free[0]])
    sp = llm.prepare(PROMPT, SamplingParams(temperature=0.0, bad_words=[word])).sampling_params
    assert (free[0],) in (sp.bad_words_token_ids or ())  # with_tokenizer filled the ids
    banned = list(_greedy(llm, ignore_eos=True, bad_words=[word]).token_ids)
    assert free[0] not in banned


def test_penalties_reach_the_engine_and_change_greedy(llm: LLM) -> None:
    free = list(_greedy(llm, ignore_eos=True, max_tokens=16).token_ids)
    assert len(set(free)) < len(free)  # the random model repeats itself: a penalty can show
    seen = _received(llm)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=2.0)
        penalised = list(llm.generate(PROMPT, sp).outputs[0].token_ids)
    finally:
        del llm._executor.enqueue_request  # back to the class's method
    assert seen[0].presence_penalty == 2.0 and seen[0].repetition_penalty == 1.0
    assert penalised != free and len(set(penalised)) > len(set(free))


def test_out_of_vocab_ids_fail_for_that_request_only(llm: LLM) -> None:
    vocab = llm._executor.sampler.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    # Straight to the engine (no front-end check): that request fails, its neighbour runs.
    ids = llm.tokenizer.encode(PROMPT)
    bad = LlmRequest(10_001, ids, SamplingParams(max_tokens=2, logit_bias={vocab + 5: 1.0}))
    good = LlmRequest(10_002, ids, SamplingParams(max_tokens=2, ignore_eos=True))
    answers: queue.Queue[Any] = queue.Queue()
    llm._executor.enqueue_request(bad, answers.put)
    llm._executor.enqueue_request(good, answers.put)
    final = {}
    while len(final) < 2:
        resp = answers.get(timeout=30)
        if resp.finished:
            final[resp.request_id] = resp
    assert final[10_001].error_code == ERROR_INVALID_INPUT and "logit_bias" in final[10_001].error
    assert final[10_002].finish_reason == "length"


def test_process_mode_applies_them_too(ckpt: Path, llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5, min_tokens=2
    )
    want = list(llm.generate(PROMPT, params).outputs[0].token_ids)
    assert want != list(_greedy(llm, ignore_eos=True, max_tokens=8).token_ids)  # it shows
    with LLM(str(ckpt), executor_mode="process", **KWARGS) as proc:
        got = list(proc.generate(PROMPT, params).outputs[0].token_ids)
    assert got == want


def test_generation_config_penalties_default_the_unset_fields(tmp_path: Path, llm: LLM) -> None:
    ckpt = write_tiny_checkpoint("qwen2", tmp_path, generation_config=GEN_CONFIG)
    with LLM(str(ckpt), executor_mode="inproc", **KWARGS) as engine:
        seen = _received(engine)
        defaulted = list(_greedy(engine, ignore_eos=True, max_tokens=16).token_ids)
        _greedy(engine, repetition_penalty=1.0)
    assert (seen[0].repetition_penalty, seen[0].presence_penalty) == (1.3, 0.5)
    assert (seen[1].repetition_penalty, seen[1].presence_penalty) == (1.0, 0.5)  # own value wins
    explicit = _greedy(llm, ignore_eos=True, max_tokens=16, **GEN_CONFIG)
    assert defaulted == list(explicit.token_ids)  # the same weights (seed 0), the same penalties
    assert defaulted != list(_greedy(llm, ignore_eos=True, max_tokens=16).token_ids)
