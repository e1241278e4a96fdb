"""request_lifecycle: token appends and token-id stop conditions, applied by the executor."""

from __future__ import annotations

import pytest

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.request_lifecycle import apply_new_tokens
from tensorrt_llm.sampling_params import SamplingParams


def _gen_req(rid: int, **kwargs) -> LlmRequest:
    """A request already in generation (its prompt is prefilled)."""
    req = LlmRequest(rid, [1, 2, 3], SamplingParams(**kwargs))
    req.context_chunk_size = 3
    req.add_new_token(0)
    req.output_token_ids.clear()  # start from an empty output for the stop tests
    return req


def _ctx_req(rid: int, **kwargs) -> LlmRequest:
    req = LlmRequest(rid, [1, 2, 3], SamplingParams(**kwargs))
    req.context_chunk_size = 3
    return req


# ---- stop conditions ---------------------------------------------------------------------------
def test_end_id_stop_and_ignore_eos() -> None:
    stop = _gen_req(0, end_id=8)
    ignore = _gen_req(1, end_id=8, ignore_eos=True, max_tokens=5)
    apply_new_tokens([stop, ignore], [8, 8])
    assert stop.is_finished and stop.finish_reason == "stop" and stop.stop_reason == 8
    assert not ignore.is_finished and ignore.output_token_ids == [8]


def test_stop_token_ids_and_length() -> None:
    req = _gen_req(0, stop_token_ids=[6], max_tokens=10)
    length = _gen_req(1, max_tokens=2)
    apply_new_tokens([req, length], [0, 0])
    apply_new_tokens([req, length], [6, 6])
    assert (req.finish_reason, req.stop_reason) == ("stop", 6)
    assert length.finish_reason == "length" and length.output_token_ids == [0, 6]


def test_stop_strings_are_not_the_engines() -> None:
    # Stop strings are text: the front end finds them while detokenizing (llmapi/outputs.py)
    # and cancels the request; the engine, which never decodes, runs on to max_tokens.
    req = _gen_req(0, stop="STOP", max_tokens=3)
    for token in [4, 5, 1]:
        apply_new_tokens([req], [token])
    assert (req.finish_reason, req.stop_reason) == ("length", None)
    assert req.output_token_ids == [4, 5, 1]


def test_stop_checked_before_length() -> None:
    req = _gen_req(0, end_id=8, max_tokens=1)
    apply_new_tokens([req], [8])
    assert req.finish_reason == "stop"


def test_partial_context_chunks_produce_no_token() -> None:
    partial = LlmRequest(0, [1, 2, 3, 4], SamplingParams())
    partial.context_chunk_size = 2
    last = _ctx_req(1)
    last.move_to_next_context_chunk()  # order with the executor's chunk advance must not matter
    done = _gen_req(2)
    done.cancel()
    apply_new_tokens([partial, last, done], [5, 6, 7])
    assert partial.output_token_ids == [] and partial.is_context_init
    assert last.output_token_ids == [6] and last.is_generation and last.first_token_time
    assert done.output_token_ids == [] and done.finish_reason == "cancelled"
    with pytest.raises(ValueError, match="tokens"):
        apply_new_tokens([last], [1, 2])


def test_in_flight_tokens_resolve_in_order_and_stop_on_real_counts() -> None:
    req = _gen_req(0, max_tokens=2)
    req.add_in_flight_token()
    req.add_in_flight_token()  # the overlap scheduler launched the next step already
    apply_new_tokens([req], [4], in_flight=True)
    assert req.output_token_ids == [4] and not req.is_finished  # 1 real token of 2
    apply_new_tokens([req], [5], in_flight=True)
    assert req.output_token_ids == [4, 5] and req.finish_reason == "length"
    assert req.num_in_flight_tokens == 0
