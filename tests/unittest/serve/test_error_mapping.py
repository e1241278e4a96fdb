"""How the server turns LLM errors into HTTP errors: by exception type and error code, never
by the words of a message."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tensorrt_llm.llmapi import PromptTooLongError
from tensorrt_llm.serve.llm_client import LLMClient
from tensorrt_llm.serve.openai_protocol import APIError, result_error


@pytest.mark.parametrize(
    "error_code,status",
    [
        ("prompt_too_long", 400),
        ("invalid_input", 400),
        ("shutting_down", 503),
        ("engine_error", 500),
        (None, 500),
    ],
)
def test_result_error_status_follows_the_code(error_code: str | None, status: int) -> None:
    # The message mentions max_seq_len either way: only the code decides.
    error = result_error("step failed: index exceeds max_seq_len", error_code)
    assert error.status == status and error.code == error_code
    assert error.type == ("invalid_request_error" if status < 500 else "internal_server_error")


class _RaisingLLM:
    """Just enough of an LLM for `LLMClient.submit`: submission raises `exc`."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.tokenizer = None

    def generate_async(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize(
    "exc,code",
    [
        (PromptTooLongError("prompt of 9 tokens is too long"), "prompt_too_long"),
        # A plain ValueError whose text looks like a length problem is still just bad input.
        (ValueError("image exceeds the max_seq_len-sized budget"), "invalid_prompt"),
    ],
)
def test_submit_maps_value_errors_by_type(exc: Exception, code: str) -> None:
    client = LLMClient(_RaisingLLM(exc), model_name="m")
    with pytest.raises(APIError) as info:
        asyncio.run(client.submit("hi", None, streaming=False))
    assert info.value.status == 400 and info.value.code == code
    assert info.value.message == str(exc)
