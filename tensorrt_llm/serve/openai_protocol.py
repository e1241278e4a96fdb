"""Pydantic models of the OpenAI-compatible API's requests: chat and text completions and the
decoding knobs they share. Responses and stream chunks are in `openai_responses.py`, a chat
request's messages and tools in `openai_messages.py`, errors in `openai_errors.py` (all
re-exported here, the handlers' one import).

Requests are validated here (types and ranges); server limits are checked in `openai_server`.
Nothing a request asks for is dropped silently: a top-level field this server does not know,
or one it knows but does not implement set to a value that would change the output, is a 400
naming it (`request_fields.check_request_fields`). Only `IGNORED_REQUEST_FIELDS` (bookkeeping
that never changes what is generated) are accepted and ignored; nested objects reject unknown
keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import ConfigDict, Field, field_validator, model_validator

from .openai_errors import (  # noqa: F401 (re-exported: the handlers' one import)
    APIError,
    ErrorInfo,
    ErrorResponse,
    result_error,
    validation_error_message,
)
from .openai_logprobs import (  # noqa: F401 (re-exported: response models)
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from .openai_messages import (  # noqa: F401 (re-exported: the content parts)
    ChatMessage,
    ChatTool,
    ImageURLPart,
    NamedToolChoice,
    TextPart,
    VideoURLPart,
)
from .openai_responses import (  # noqa: F401 (re-exported: the handlers' one import)
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
    now_s,
    random_id,
)
from .protocol_base import (  # noqa: F401 (re-exported: OpenAIBaseModel)
    OpenAIBaseModel,
    StrictRequestModel,
)

# OpenAI documents at most 4 stop sequences; a cap keeps the per-token stop check cheap.
MAX_STOP_SEQUENCES = 4
MAX_N = 16
# OpenAI's top_logprobs bound; also the largest completions `logprobs` (vLLM's max_logprobs).
MAX_TOP_LOGPROBS = 20
_MAX_SEED = 2**64 - 1


# ---------------------------------------------------------------- shared request knobs


class StreamOptions(StrictRequestModel):
    include_usage: bool = False


StopField = Annotated[
    str | list[str] | None,
    Field(default=None, description="stop sequences (a string or up to 4 strings)"),
]


class JsonSchemaFormat(StrictRequestModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    # NOTE: "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictRequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequestFields(StrictRequestModel):
    """Decoding knobs shared by chat and text completions."""

    model: str
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0)] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    # -1 (vLLM's spelling) and 0 both mean "no top-k filter".
    top_k: Annotated[int | None, Field(ge=-1)] = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    stop: StopField = None
    seed: Annotated[int | None, Field(ge=0, le=_MAX_SEED)] = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    # Extension (vLLM): prefix-cache isolation; only requests of the same salt share KV blocks.
    cache_salt: Annotated[str | None, Field(min_length=1, max_length=1024)] = None
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    frequency_penalty: Annotated[float | None, Field(ge=-2.0, le=2.0)] = None
    # OpenAI: token id (as a string key) -> bias added to its logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # Extensions (vLLM names).
    repetition_penalty: Annotated[float | None, Field(gt=0.0, le=10.0)] = None
    min_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    min_tokens: Annotated[int | None, Field(ge=0)] = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    # Structured output: OpenAI's response_format, or one of vLLM's guided_* extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's scheduling priority: lower is admitted first and preempted last (default 0).
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0

    # vLLM's: logprobs of the prompt tokens (+ the top k) in the response (not streamed).
    prompt_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # OpenAI's fields are nullable (`n`, `stream`, `echo`: "integer or null"), null meaning
        # "not given": a client library that sends it gets the default, not a 400.
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None
            or k not in fields
            or fields[k].is_required()
            or fields[k].default is None
        }

    @model_validator(mode="after")
    def _check_stream_fields(self) -> SamplingRequestFields:
        # As vLLM: whole responses only (a stream has no place for them).
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        # As OpenAI: options of a stream on a whole response would be dropped unread.
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key[:32]!r}")
        return value

    def unsupported_features(self) -> str | None:
        """Name a feature the request asks for that this server cannot honour, if any."""
        return None


# ---------------------------------------------------------------- chat completions


class ChatCompletionRequest(SamplingRequestFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # The newer OpenAI name of max_tokens; wins when both are given.
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    # Extension (vLLM): variables for the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        # OpenAI (and vLLM): top_logprobs is only meaningful with logprobs on.
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: the top alternatives per token, None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------- text completions

PromptField = (
    str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
)


def _prompt_item_kind(item: Any) -> str | None:
    """The form one element of a list prompt has: a string, a token id, a token-id list."""
    if isinstance(item, str):
        return "text"
    if isinstance(item, int) and not isinstance(item, bool):
        return "id"
    if isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return "ids"
    return None


class CompletionRequest(SamplingRequestFields):
    prompt: PromptField
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int | None, Field(ge=1)] = None
    # The top alternatives per token (the sampled token's logprob always comes with them).
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_form(cls, value: Any) -> Any:
        # NOTE: before the union is tried, whose errors list each form's complaint about a
        # mixed list ("a valid string"; "a valid integer"; ...) instead of naming the forms.
        if isinstance(value, str) or value == []:
            return value
        kinds = {_prompt_item_kind(v) for v in value} if isinstance(value, list) else {None}
        if len(kinds) != 1 or None in kinds:
            raise ValueError(
                "expected a string, a list of strings, a list of token ids, or a list of "
                "token-id lists (one form for the whole list)"
            )
        return value

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: PromptField) -> PromptField:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be an empty list")
            if any(isinstance(v, list) and not v for v in value):
                raise ValueError("a token-id prompt must not be empty")
        return value

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        # NOTE: the casts only narrow for mypy (an `all(isinstance)` check does not).
        if all(isinstance(v, int) for v in value):
            return [list(cast("list[int]", value))]  # one token-id prompt
        return list(cast("list[str | list[int]]", value))

    @property
    def sampled_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: the request's, or its logprobs when echo needs the
        prompt tokens' logprobs too (the larger of the two when both are given)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def unsupported_features(self) -> str | None:
        if self.suffix:
            return "suffix is not supported"
        if self.best_of not in (None, self.n):
            return "best_of != n is not supported"
        return super().unsupported_features()
