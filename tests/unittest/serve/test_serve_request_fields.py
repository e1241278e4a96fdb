"""Nothing a request asks for is dropped silently (`openai_protocol.check_request_fields`):
unknown fields and implemented-later fields with a value that would change the output get a
400 naming them; bookkeeping fields and "off" values are accepted."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tensorrt_llm.serve.chat_utils import to_sampling_params
from tensorrt_llm.serve.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from tensorrt_llm.serve.request_fields import (
    IGNORED_REQUEST_FIELDS,
    NOT_IMPLEMENTED_FIELDS,
    check_request_fields,
)

CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields)


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def _checked(body: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(check_request_fields(body, CHAT_FIELDS))


@pytest.mark.parametrize(
    "field,value",
    [
        ("echo", True),  # chat's: vLLM echoes the last message; not implemented
        ("use_beam_search", True),
        ("guided_decoding_backend", "outlines"),
    ],
)
def test_not_implemented_values_are_400_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(APIError) as info:
        _checked(_chat(**{field: value}))
    assert info.value.status == 400 and info.value.param == field
    assert field in info.value.message and info.value.code == "unsupported_feature"


@pytest.mark.parametrize(
    "field,value",
    [
        ("logprobs", False),
        ("logprobs", True),
        ("prompt_logprobs", 0),
        ("prompt_logprobs", 20),
        ("echo", False),
        ("response_format", {"type": "text"}),
        ("skip_special_tokens", True),
    ],
)
def test_off_values_are_accepted(field: str, value: Any) -> None:
    assert _checked(_chat(**{field: value})).model == "m"


def test_bookkeeping_fields_are_accepted_and_dropped() -> None:
    body = _chat(user="u1", metadata={"k": "v"}, store=False, service_tier="auto")
    kept = check_request_fields(body, CHAT_FIELDS)
    assert set(kept) == {"model", "messages"}
    assert {"user", "metadata", "store", "service_tier"} <= IGNORED_REQUEST_FIELDS


def test_unknown_fields_are_400() -> None:
    with pytest.raises(APIError) as info:
        _checked(_chat(temprature=0.5))  # a typo must not run with the default temperature
    assert info.value.status == 400 and info.value.param == "temprature"
    assert "unknown request field" in info.value.message
    completion = frozenset(CompletionRequest.model_fields)
    with pytest.raises(APIError, match="best_of"):
        check_request_fields(_chat(best_of=2), CHAT_FIELDS)  # a completions-only field
    assert check_request_fields({"model": "m", "prompt": "x", "best_of": 1}, completion)


def test_nested_unknown_keys_are_validation_errors() -> None:
    bad_message = _chat(messages=[{"role": "user", "content": "hi", "refusal": "no"}])
    bad_part = _chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]
    )
    bad_options = _chat(stream=True, stream_options={"include_usage": True, "continuous": 1})
    for body in (bad_message, bad_part, bad_options):
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            _checked(body)


def test_every_not_implemented_field_has_an_off_value_or_none() -> None:
    # Each predicate accepts "absent" (None): a client library sending null is fine.
    assert all(is_off(None) for is_off in NOT_IMPLEMENTED_FIELDS.values())
    assert not set(NOT_IMPLEMENTED_FIELDS) & CHAT_FIELDS  # implemented fields leave the list


def test_include_stop_str_in_output_reaches_sampling_params() -> None:
    body = _checked(_chat(include_stop_str_in_output=True, stop=["x"]))
    assert to_sampling_params(body, 8).include_stop_str_in_output is True


def test_special_token_fields_reach_sampling_params() -> None:
    params = to_sampling_params(_checked(_chat()), 8)
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    body = _checked(_chat(skip_special_tokens=False, spaces_between_special_tokens=False))
    params = to_sampling_params(body, 8)
    assert not params.skip_special_tokens and not params.spaces_between_special_tokens


def test_penalties_and_processors_reach_sampling_params() -> None:
    body = _checked(
        _chat(
            presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.1, min_p=0.05,
            min_tokens=3, logit_bias={"7": -100, "12": 2.5}, bad_words=["foo bar"],
        )
    )  # fmt: skip
    sp = to_sampling_params(body, 8)
    assert (sp.presence_penalty, sp.frequency_penalty) == (1.5, -0.5)
    assert (sp.repetition_penalty, sp.min_p, sp.min_tokens) == (1.1, 0.05, 3)
    assert sp.logit_bias == {7: -100.0, 12: 2.5} and sp.bad_words == ["foo bar"]
    plain = to_sampling_params(_checked(_chat()), 8)
    assert "presence_penalty" in plain.unset_fields  # left to generation_config.json


def test_structured_output_fields_make_guided_decoding() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert (
        to_sampling_params(_checked(_chat(response_format=fmt)), 8).guided_decoding.json == schema
    )
    obj = to_sampling_params(_checked(_chat(response_format={"type": "json_object"})), 8)
    assert obj.guided_decoding.json_object is True
    assert (
        to_sampling_params(_checked(_chat(response_format={"type": "text"})), 8).guided_decoding
        is None
    )
    choice = to_sampling_params(_checked(_chat(guided_choice=["y", "n"])), 8).guided_decoding
    assert choice.choice == ["y", "n"]
    with pytest.raises(APIError, match="one structured-output constraint"):
        to_sampling_params(_checked(_chat(guided_regex="a+", guided_choice=["a"])), 8)
    with pytest.raises(APIError, match="guided_choice"):
        to_sampling_params(_checked(_chat(guided_choice=[])), 8)
    with pytest.raises(APIError, match="needs json_schema.schema"):
        to_sampling_params(_checked(_chat(response_format={"type": "json_schema"})), 8)
