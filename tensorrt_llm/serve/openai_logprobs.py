"""OpenAI's logprobs objects of a response choice (chat and text completions).

Built as plain dicts in this field order by `logprobs_format.py` (stream chunks skip the
models); a test holds the two equal.
"""

from __future__ import annotations

from pydantic import Field

from .protocol_base import OpenAIBaseModel


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's `Logprob` of one token of a prompt position (`prompt_logprobs` entries)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: per prompt position None (the first) or token id -> its Logprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]
