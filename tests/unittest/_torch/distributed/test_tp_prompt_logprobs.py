"""`SamplingParams.prompt_logprobs` at tensor_parallel_size=2 (2 gloo ranks on the CPU): the
worker runs the hidden-state forward and the LM-head slices rank 0 runs (the step header
carries the plan's rows), so the vocab-parallel head's collectives pair up; rank 0's entries
equal TP=1's: the same prompt tokens, ranks and top-k ids, logprobs within `ATOL` (the
row-parallel all-reduce sums in another order than one GPU's GEMM). Chunked prefill (16-token
steps) and LM-head slices of 3 rows (set on both ranks) included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tp_feature_bodies import prompt_logprobs_tp1_and_tp
from tp_harness import spawn_ranks

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

KWARGS = dict(device="cpu", max_batch_size=2, max_num_tokens=16)
PROMPTS = ["the quick brown fox jumps over the lazy dog, again and again", "a b c", "hello"]
ATOL = 1e-4


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3, logprobs=2),
        SamplingParams(max_tokens=4, temperature=0.0),  # asks for none
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0),
    ]


def _close(got: list[Any], want: list[Any]) -> None:
    """Entries of one prompt (LLM API dicts: token -> Logprob) against TP=1's."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for mine, theirs in zip(got[1:], want[1:], strict=True):
        assert list(mine) == list(theirs)  # the prompt token, then the top k in order
        for token, value in mine.items():
            assert value.rank == theirs[token].rank
            assert value.logprob == pytest.approx(theirs[token].logprob, abs=ATOL)


def test_llm_tp2_prompt_logprobs_equal_tp1(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    with LLM(str(ckpt), **KWARGS) as llm:
        reference = llm.generate(PROMPTS, _params())
    with LLM(str(ckpt), tensor_parallel_size=2, **KWARGS) as llm:
        outputs = llm.generate(PROMPTS, _params())
    assert len(reference[0].prompt_token_ids) > 16  # chunked: several steps
    for mine, theirs in zip(outputs, reference, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        if theirs.prompt_logprobs is None:
            assert mine.prompt_logprobs is None
        else:
            _close(mine.prompt_logprobs, theirs.prompt_logprobs)


def test_tp2_prompt_logprobs_in_lm_head_slices(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    (reference, sharded), worker_steps = spawn_ranks(prompt_logprobs_tp1_and_tp, 2, str(ckpt), 3)
    assert worker_steps > 0
    for mine, theirs in zip(sharded, reference, strict=True):
        assert mine["tokens"] == theirs["tokens"]
        assert len(mine["prompt"]) == len(theirs["prompt"]) > 0
        for a, b in zip(mine["prompt"], theirs["prompt"], strict=True):
            assert (a.rank, a.top_ids) == (b.rank, b.top_ids)
            assert a.logprob == pytest.approx(b.logprob, abs=ATOL)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=ATOL)
