"""Pydantic models of the OpenAI-compatible API's responses: whole chat and text completions,
stream chunks, usage and the model list (the requests are in `openai_protocol.py`)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from .openai_logprobs import ChatChoiceLogprobs, CompletionLogprobs, PromptLogprobs
from .protocol_base import OpenAIBaseModel


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(OpenAIBaseModel):
    # Prompt tokens served from the prefix cache (RequestOutput.num_cached_tokens; 0 with
    # kv_cache_config.enable_block_reuse off).
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    # NOTE: prompt_tokens is the full expanded prompt, vision tokens included.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning_parser
    tool_calls: list[dict[str, Any]] | None = None  # --tool_call_parser, OpenAI's shape


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    # vLLM's extension, with the request's `prompt_logprobs` (where vLLM puts it for chat).
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    # vLLM's extension, with the request's `prompt_logprobs` (never in stream chunks).
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "tensorrt_llm"
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
