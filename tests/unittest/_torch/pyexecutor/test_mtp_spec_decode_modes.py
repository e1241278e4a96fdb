"""MTP speculation in the default process executor mode (the config crosses the process
boundary) and beside a structured-output request (which verifies no drafts): the outputs
equal the non-speculative run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.sampling_params import GuidedDecodingParams
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
ENGINE = {"disable_overlap_scheduler": True, "max_num_tokens": 16, "tokens_per_block": 4}
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (15, 4)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("mtp_modes") / "ckpt",
                                 mtp_num_hidden_layers=1)  # fmt: skip


def _tokens(ckpt: Path, params: list[SamplingParams], **kwargs: Any) -> list[list[int]]:
    with LLM(model=str(ckpt), **ENGINE, **kwargs) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


def test_process_mode(ckpt: Path) -> None:
    params = [SamplingParams(max_tokens=9, temperature=0)] * 2
    reference = _tokens(ckpt, params, executor_mode="process")
    assert _tokens(ckpt, params, executor_mode="process", speculative_config=MTP) == reference


def test_guided_request_beside_drafting_ones(ckpt: Path) -> None:
    pytest.importorskip("xgrammar")
    guided = GuidedDecodingParams(regex="(ab|cd){2,4}")
    params = [
        SamplingParams(max_tokens=12, temperature=0, guided_decoding=guided),
        SamplingParams(max_tokens=9, temperature=0),
    ]
    reference = _tokens(ckpt, params, executor_mode="inproc")
    assert _tokens(ckpt, params, executor_mode="inproc", speculative_config=MTP) == reference
