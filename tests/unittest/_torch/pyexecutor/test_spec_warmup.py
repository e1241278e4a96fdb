"""The startup warm-up of speculative (MTP) steps (`spec_decode/spec_warmup.py`), on the CPU.

With the warm-up on (`TRTLLM_WARMUP=1`; on CUDA it is on by default) an MTP engine serves its
dummy waves before the loop is armed: every batch class, rejected, accepted and partly
accepted drafts, and rollbacks on a hybrid model. Afterwards its counters read zero, and the
user's requests give the tokens an engine without the warm-up gives.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.spec_decode.spec_warmup import (
    spec_warmup_batches,
    spec_warmup_prompt_lengths,
)
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
ENGINE = {
    "executor_mode": "inproc",
    "disable_overlap_scheduler": False,
    "max_num_tokens": 32,
    "tokens_per_block": 4,
    "max_batch_size": 5,
}
PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((7, 23, 3))]
_REPORT = re.compile(
    r"speculative warm-up: (\d+) requests in (\d+) waves \(batches \[([\d, ]+)\], prompt lengths "
    r"\[([\d, ]+)\]\), (\d+) verify rows, (\d+) of (\d+) drafts accepted, (\d+) rollbacks"
)


def test_batches_and_prompt_lengths_cover_every_class() -> None:
    assert spec_warmup_prompt_lengths(8192, 100_000)[-4:] == [4095, 4096, 8191, 8192]
    assert spec_warmup_prompt_lengths(100, 50) == [1, 2, 3, 4, 7, 15, 16, 31, 32, 49, 50]
    assert spec_warmup_batches(1) == [1]
    assert spec_warmup_batches(5) == [1, 2, 3, 4, 5]
    assert spec_warmup_batches(64) == [1, 2, 3, 4, 8, 16, 32, 64]
    assert spec_warmup_batches(100) == [1, 2, 3, 4, 8, 16, 32, 64, 100]


def _generate(ckpt: Path, warmup: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list, object]:
    monkeypatch.setenv("TRTLLM_WARMUP", warmup)
    params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)
    with LLM(model=str(ckpt), speculative_config=MTP, **ENGINE) as llm:
        executor = llm._executor
        stats_before = executor.get_stats()
        spec_before = replace(executor.spec_decoder.stats)  # a copy: generate adds to it
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    return outs, (stats_before, spec_before)


def test_warmup_serves_every_path_then_leaves_no_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = write_tiny_checkpoint("qwen3_5", tmp_path / "ckpt", mtp_num_hidden_layers=1)
    logger = "tensorrt_llm._torch.pyexecutor.spec_decode.spec_warmup"
    with caplog.at_level(logging.INFO, logger=logger):
        warmed, (stats, spec) = _generate(ckpt, "1", monkeypatch)
    match = next(m for m in map(_REPORT.search, caplog.messages) if m)
    requests, waves, batches, lengths, rows, accepted, drafts, rollbacks = match.groups()
    assert [int(b) for b in batches.split(",")] == [1, 2, 3, 4, 5]
    # One prompt per length class up to max_num_tokens (32): the head's first pass covers
    # each prefill chunk (8 is the batch waves' own length).
    assert [int(n) for n in lengths.split(",")] == [1, 2, 3, 4, 7, 15, 16, 31, 32]
    assert (int(requests), int(waves)) == (15 + 9, 5 + 9)
    # Rejected, accepted and partly accepted drafts all ran, and the hybrid rows rolled back.
    assert 0 < int(accepted) < int(drafts) and int(rows) > 0 and int(rollbacks) > 0
    # The user sees none of it: counters from zero, and the same tokens as without it.
    assert (stats.num_completed, stats.num_failed, stats.num_steps) == (0, 0, 0)
    assert stats.num_running == 0 and stats.num_free_seq_slots == stats.num_total_seq_slots
    assert spec.num_verify_rows == 0 and spec.num_draft_tokens == 0
    plain, _ = _generate(ckpt, "0", monkeypatch)
    assert warmed == plain


def test_no_warmup_without_speculation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TRTLLM_WARMUP", "1")
    ckpt = write_tiny_checkpoint("qwen3_5", tmp_path / "ckpt")
    logger = "tensorrt_llm._torch.pyexecutor.spec_decode.spec_warmup"
    with caplog.at_level(logging.INFO, logger=logger):
        with LLM(model=str(ckpt), **ENGINE) as llm:
            assert llm._executor.get_stats().num_steps == 0
    assert not any("speculative warm-up" in m for m in caplog.messages)


def test_a_failed_warmup_request_fails_startup_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm-up request the engine rejects (here: a token id past the vocabulary) stops the
    startup with a RuntimeError that carries its error, and the executor is shut down."""
    from tensorrt_llm._torch.pyexecutor.spec_decode import spec_warmup

    made = spec_warmup._dummy_request

    def bad(rid: int, *args: object) -> LlmRequest:
        req = made(rid, *args)  # type: ignore[arg-type]
        ids = [10**6, *(int(t) for t in req.prompt_token_array[1:])]
        return LlmRequest(rid, ids, req.sampling_params, multimodal_params=req.multimodal_params)

    monkeypatch.setenv("TRTLLM_WARMUP", "1")
    monkeypatch.setattr(spec_warmup, "_dummy_request", bad)
    ckpt = write_tiny_checkpoint("qwen3_5", tmp_path / "ckpt", mtp_num_hidden_layers=1)
    with pytest.raises(RuntimeError, match="speculative warm-up: a request of a wave of 1"):
        LLM(model=str(ckpt), speculative_config=MTP, **ENGINE)
