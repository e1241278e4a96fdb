"""LlmRequest: validation, sizes, state transitions, chunk bookkeeping, token counts, metrics,
preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("prompt", "word"),
    [([], "non-empty"), ([[1, 2]], "1-D"), ([1, -1], "non-negative"), ([0.5, 1.0], "ints")],
)
def test_bad_prompt_raises(prompt: list, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        LlmRequest(0, prompt, SamplingParams())


def test_sizes_and_token_views() -> None:
    req = LlmRequest(3, [5, 6, 7], SamplingParams(max_tokens=4))
    assert req.prompt_len == 3 and req.num_tokens == 3 and req.max_num_tokens == 7
    assert req.prompt_token_ids == [5, 6, 7]
    assert req.prompt_token_array.dtype == np.int64
    with pytest.raises(ValueError):
        req.prompt_token_array[0] = 1  # read-only: the prompt never changes
    req.context_chunk_size = 3
    req.add_new_token(9)
    assert req.num_tokens == 4 and req.all_token_ids == [5, 6, 7, 9]
    assert req.num_generated_tokens == 1


def test_chunked_context_then_generation() -> None:
    req = LlmRequest(1, list(range(10)), SamplingParams())
    assert req.is_context_init and req.is_first_context_chunk
    req.context_chunk_size = 4
    assert not req.is_last_context_chunk
    req.move_to_next_context_chunk()
    assert (req.context_current_position, req.context_chunk_size) == (4, 0)
    assert req.context_remaining_length == 6 and not req.is_first_context_chunk
    req.context_chunk_size = 6
    assert req.is_last_context_chunk
    req.add_new_token(42)  # the last chunk's token moves the request into generation
    assert req.is_generation and req.context_current_position == 10
    assert req.context_chunk_size == 0
    req.move_to_next_context_chunk()  # a late call is harmless
    assert req.context_current_position == 10


def test_finish_keeps_first_reason_and_rejects_unknown() -> None:
    req = LlmRequest(1, [1], SamplingParams())
    with pytest.raises(ValueError, match="finish reason"):
        req.finish("done")
    req.finish("length")
    req.cancel()
    assert req.is_finished and req.finish_reason == "length"
    assert req.state is LlmRequestState.GENERATION_COMPLETE
    with pytest.raises(ValueError, match="finished"):
        req.add_new_token(3)
    err = LlmRequest(2, [1], SamplingParams())
    err.set_error("boom")
    assert (err.finish_reason, err.error) == ("error", "boom")


def test_metrics_from_timestamps() -> None:
    req = LlmRequest(1, [1, 2], SamplingParams(), arrival_time=10.0)
    assert req.ttft is None and req.mean_itl is None
    req.add_new_token(5, now=10.5)
    req.add_new_token(6, now=10.7)
    req.add_new_token(7, now=11.1)
    assert req.ttft == pytest.approx(0.5)
    assert req.mean_itl == pytest.approx(0.3)


@settings(max_examples=50, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    token=st.integers(0, 5),
    data=st.data(),
)
def test_count_tokens_matches_python_count(prompt: list[int], token: int, data) -> None:
    req = LlmRequest(0, prompt, SamplingParams())
    start = data.draw(st.integers(0, len(prompt)))
    end = data.draw(st.integers(start, len(prompt)))
    assert req.count_tokens_before(token, end) == prompt[:end].count(token)
    assert req.count_tokens_in_range(token, start, end) == prompt[start:end].count(token)


def test_count_tokens_rejects_out_of_range() -> None:
    req = LlmRequest(0, [1, 2, 1], SamplingParams())
    with pytest.raises(ValueError, match="position"):
        req.count_tokens_before(1, 4)
    with pytest.raises(ValueError, match="start"):
        req.count_tokens_in_range(1, 2, 1)


def test_preempt_folds_the_outputs_into_the_context() -> None:
    pixels = torch.ones(2, 3)
    mm = MultimodalParams({"image": {"pixel_values": pixels}})
    req = LlmRequest(0, [5, 6, 7], SamplingParams(max_tokens=6, priority=2), mm)
    assert req.priority == 2 and req.context_len == 3
    mm.keep_for_recompute()
    mm.multimodal_data["image"]["pixel_values"] = pixels * 2  # a device move replaces leaves
    req.context_chunk_size = 3
    req.add_new_token(8)
    req.add_new_token(9)
    mm.strip_for_generation()
    req.seq_slot = 1
    req.preempt()
    assert req.is_context_init and req.seq_slot is None and req.is_preempted
    assert req.context_len == 5 and req.context_current_position == 0
    assert req.context_token_array.tolist() == [5, 6, 7, 8, 9]
    assert req.prompt_token_ids == [5, 6, 7] and req.output_token_ids == [8, 9]
    assert mm.multimodal_data["image"]["pixel_values"] is pixels  # the payload as it came
    # The recompute's last chunk samples output number 2; the prompt is untouched.
    req.context_chunk_size = 5
    assert req.is_last_context_chunk
    req.add_new_token(4)
    assert req.is_generation and req.output_token_ids == [8, 9, 4] and req.num_tokens == 6
    assert not req.is_preempted and req.num_preemptions == 1


def test_preempt_refuses_in_flight_and_finished() -> None:
    req = LlmRequest(0, [1, 2], SamplingParams(max_tokens=4))
    req.context_chunk_size = 2
    req.add_in_flight_token()
    with pytest.raises(ValueError, match="in flight"):
        req.preempt()
    req.finish("cancelled")
    with pytest.raises(ValueError, match="finished"):
        req.preempt()
