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


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_forced_acceptance_emits_the_drafts_then_the_target_token(
    ckpt: Path, temperature: float
) -> None:
    """`accept_override` (trtllm-bench's bounds): all drafts accepted, or none, for greedy
    and rejection-sampled rows alike; an accepted draft is emitted as drafted."""
    params = [SamplingParams(max_tokens=9, temperature=temperature, seed=3)] * 2
    with LLM(model=str(ckpt), **ENGINE, executor_mode="inproc", speculative_config=MTP) as llm:
        decoder = llm._executor.spec_decoder
        for forced, want in ((lambda m: m, 1.0), (lambda m: 0, 0.0)):
            drafted: list[tuple[Any, int, list[int]]] = []  # (request, tokens so far, drafts)

            def record(
                req: Any, drafts: list[int], into: list[tuple[Any, int, list[int]]] = drafted
            ) -> list[int]:
                into.append((req, len(req.output_token_ids), list(drafts)))
                return drafts

            before = (decoder.stats.num_draft_tokens, decoder.stats.num_accepted_tokens)
            decoder.accept_override, decoder.draft_override = forced, record
            outs = llm.generate(PROMPTS, params)
            decoder.accept_override = decoder.draft_override = None
            drafts = decoder.stats.num_draft_tokens - before[0]
            accepted = decoder.stats.num_accepted_tokens - before[1]
            assert drafts > 0 and accepted == want * drafts
            assert all(len(o.outputs[0].token_ids) == 9 for o in outs)
            if want:  # each step's drafts are the next step's tokens, as drafted
                checked = [(r, n, d) for r, n, d in drafted if d and n + len(d) < 9]
                assert checked
                for req, n, d in checked:
                    assert list(req.output_token_ids[n : n + len(d)]) == d
