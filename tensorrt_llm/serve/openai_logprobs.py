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
