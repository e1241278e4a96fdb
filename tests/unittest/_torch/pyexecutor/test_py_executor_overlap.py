"""The overlap scheduler gives exactly the non-overlapped results, stops included."""

from __future__ import annotations

from pathlib import Path

import pytest

import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_overlap import OverlapPyExecutor
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

DEMO_IMAGE = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")


def _prompts() -> list:
    image = {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|> what is it",
        "multi_modal_data": {"image": [DEMO_IMAGE]},
    }
    return ["hello there", image, "the weather today is", image, "numbers like 1, 2, 3"]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=5),
        SamplingParams(max_tokens=10, temperature=0.0, stop=["u"]),
        SamplingParams(max_tokens=1, temperature=0.0),
    ]


def _run(disable_overlap: bool) -> list[tuple]:
    with LLM(
        model=str(get_or_build_demo_checkpoint()),
        max_batch_size=4,
        disable_overlap_scheduler=disable_overlap,
        executor_mode="inproc",  # the test checks the executor's class
    ) as llm:
        kind = type(llm._executor)
        outs = llm.generate(_prompts(), _params(), use_tqdm=False)
    assert (kind is OverlapPyExecutor) != disable_overlap
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_overlap_matches_sequential_executor() -> None:
    overlapped = _run(disable_overlap=False)
    assert overlapped == _run(disable_overlap=True)
    assert all(min(ids) >= 0 for ids, _, _ in overlapped)  # real tokens only
    assert [len(ids) for ids, _, _ in overlapped][0] == 12
    assert len(overlapped[4][0]) == 1


def test_in_flight_counting() -> None:
    req = LlmRequest(1, [1, 2, 3])
    req.add_new_token(5)
    req.add_in_flight_token()
    req.add_in_flight_token()
    assert req.num_generated_tokens == 1 and req.output_token_ids == [5]
    assert req.num_tokens == 6  # positions already count the in-flight tokens
    req.resolve_in_flight_token(7)
    assert req.output_token_ids == [5, 7] and req.num_tokens == 6


def test_in_flight_prefill_enters_generation() -> None:
    req = LlmRequest(1, [1, 2, 3])
    req.context_chunk_size = 3
    req.add_in_flight_token()
    assert req.is_generation and req.output_token_ids == [] and req.num_tokens == 4
    with pytest.raises(ValueError, match="in flight"):
        LlmRequest(2, [1]).resolve_in_flight_token(4)


@pytest.mark.gpu
def test_overlap_matches_sequential_on_cuda() -> None:
    def run(disable: bool) -> list:
        with LLM(
            model=str(get_or_build_demo_checkpoint()),
            max_batch_size=4,
            device="cuda",
            dtype="float32",
            disable_overlap_scheduler=disable,
        ) as llm:
            return [
                o.outputs[0].token_ids for o in llm.generate(_prompts(), _params(), use_tqdm=False)
            ]

    assert run(False) == run(True)
