"""Greedy acceptance of drafts and the emitted run: stops cut it exactly where a one-token
decode loop over the same target tokens would stop."""

from __future__ import annotations

import pytest

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.request_lifecycle import apply_new_tokens
from tensorrt_llm._torch.pyexecutor.spec_decode.acceptance import (
    draft_budget,
    emit_accepted,
    num_accepted,
    wants_drafts,
)
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams


def _running(**kwargs: object) -> LlmRequest:
    req = LlmRequest(0, [1, 2, 3], SamplingParams(**kwargs))  # type: ignore[arg-type]
    req.context_chunk_size = 3
    return req


@pytest.mark.parametrize(
    ("drafts", "target", "accepted"),
    [
        ([], [7], 0),
        ([7, 8, 9], [7, 8, 9, 4], 3),
        ([7, 8, 9], [7, 5, 9, 4], 1),
        ([6, 8, 9], [7, 8, 9, 4], 0),
    ],
)
def test_num_accepted(drafts: list[int], target: list[int], accepted: int) -> None:
    assert num_accepted(drafts, target) == accepted


def test_num_accepted_needs_the_bonus_position() -> None:
    with pytest.raises(ValueError, match="3 drafts need 4 target tokens"):
        num_accepted([1, 2, 3], [1, 2, 3])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 3},
        {"max_tokens": 9, "stop_token_ids": [12]},
        {"max_tokens": 9, "end_id": 11},
        {"max_tokens": 9, "end_id": 11, "ignore_eos": True},
        {"max_tokens": 9},
    ],
)
def test_emitted_run_stops_like_single_token_steps(kwargs: dict[str, object]) -> None:
    run = [10, 11, 12, 13, 14]
    spec, plain = _running(**kwargs), _running(**kwargs)
    emitted = emit_accepted(spec, run)
    for token in run:  # the reference: one decode step per token
        if not plain.is_finished:
            apply_new_tokens([plain], [token])
    assert spec.output_token_ids == plain.output_token_ids
    assert emitted == len(plain.output_token_ids)
    assert (spec.finish_reason, spec.stop_reason) == (plain.finish_reason, plain.stop_reason)


def test_draft_budget_leaves_room_for_the_bonus_token() -> None:
    req = _running(max_tokens=5)
    assert draft_budget(req, 3) == 3
    for token in (4, 5):
        req.add_new_token(token)
    assert draft_budget(req, 3) == 2  # 3 left: 2 drafts + the bonus
    req.add_new_token(6)
    req.add_new_token(7)
    assert draft_budget(req, 3) == 0


@pytest.mark.parametrize(
    ("kwargs", "wants"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0, "logprobs": 1}, False),
        ({"temperature": 0, "repetition_penalty": 1.2}, False),
        ({"temperature": 0, "min_tokens": 2}, False),
        ({"temperature": 0, "guided_decoding": GuidedDecodingParams(regex="a+")}, False),
    ],
)
def test_which_requests_take_drafts(kwargs: dict[str, object], wants: bool) -> None:
    assert wants_drafts(_running(**kwargs)) is wants
