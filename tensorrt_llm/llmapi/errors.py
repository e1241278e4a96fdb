"""Typed request errors of the LLM API, so callers (trtllm-serve) never classify message text."""

from __future__ import annotations


class PromptTooLongError(ValueError):
    """The prompt plus max_tokens can never fit this engine: it exceeds max_seq_len, or
    max_num_tokens without chunked prefill, or the per-sequence or total KV-cache capacity.

    A `ValueError`, so code that catches bad input in general still catches it.
    """


class InvalidSamplingParamError(ValueError):
    """A SamplingParams field that does not fit this engine (e.g. a logit_bias token id past
    the vocabulary); `param` names the field, for the OpenAI error's `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
