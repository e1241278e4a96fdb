"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

Requests are validated here (types and ranges); server limits are checked in `openai_server`.
Nothing a request asks for is dropped silently: a top-level field this server does not know,
or one it knows but does not implement set to a value that would change the output, is a 400
naming it (`request_fields.check_request_fields`). Only `IGNORED_REQUEST_FIELDS` (bookkeeping
that never changes what is generated) are accepted and ignored; nested objects reject unknown
keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .._torch.pyexecutor.llm_request import (
    ERROR_INVALID_INPUT,
    ERROR_PROMPT_TOO_LONG,
    ERROR_SHUTTING_DOWN,
)
from .openai_logprobs import (  # noqa: F401 (re-exported: response models)
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
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
from .protocol_base import OpenAIBaseModel, StrictRequestModel

# OpenAI documents at most 4 stop sequences; a cap keeps the per-token stop check cheap.
MAX_STOP_SEQUENCES = 4
MAX_N = 16
# OpenAI's top_logprobs bound; also the largest completions `logprobs` (vLLM's max_logprobs).
MAX_TOP_LOGPROBS = 20
_MAX_SEED = 2**64 - 1


# ---------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class APIError(Exception):
    """Raised by handlers; the app turns it into an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,  # noqa: A002 (OpenAI's field name)
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "internal_server_error")

    def to_response(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info)


# RequestOutput.error_code -> HTTP status: a prompt that can never fit, or input the engine
# refused before running it, is the client's error; a shutdown is temporary; anything else is
# the engine's.
_RESULT_ERROR_STATUS = {
    ERROR_PROMPT_TOO_LONG: 400,
    ERROR_INVALID_INPUT: 400,
    ERROR_SHUTTING_DOWN: 503,
}


def result_error(message: str, error_code: str | None) -> APIError:
    """The APIError for a request that finished with an error inside the executor."""
    status = _RESULT_ERROR_STATUS.get(error_code or "", 500)
    return APIError(status, message, code=error_code)


def validation_error_message(exc: ValidationError, max_errors: int = 3) -> tuple[str, str | None]:
    """A readable one-line message and the `param` (dotted path) of the first error."""
    parts = []
    first_param = None
    for err in exc.errors(include_url=False)[:max_errors]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        if first_param is None and loc:
            first_param = loc
        parts.append(f"{loc}: {err.get('msg', 'invalid value')}" if loc else err.get("msg", ""))
    more = len(exc.errors()) - max_errors
    if more > 0:
        parts.append(f"... and {more} more error(s)")
    return "invalid request: " + "; ".join(parts), first_param


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

    @model_validator(mode="after")
    def _check_prompt_logprobs(self) -> SamplingRequestFields:
        # As vLLM: whole responses only (a stream has no place for them).
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
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


class TextPart(StrictRequestModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictRequestModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(StrictRequestModel):
    type: Literal["image_url"]
    image_url: ImageURL | str

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class VideoURL(StrictRequestModel):
    url: str
    # Extension: the frame rate of the given frames, for sources that do not carry one.
    fps: Annotated[float | None, Field(gt=0.0, le=240.0)] = None


class VideoURLPart(StrictRequestModel):
    type: Literal["video_url"]
    video_url: VideoURL | str

    @property
    def url(self) -> str:
        return self.video_url if isinstance(self.video_url, str) else self.video_url.url

    @property
    def fps(self) -> float | None:
        return None if isinstance(self.video_url, str) else self.video_url.fps


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class FunctionCallIn(StrictRequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallIn(StrictRequestModel):
    """A call an earlier assistant turn made (rendered by the chat template)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(StrictRequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call they answer

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs to role 'tool' messages")
        return self

    def parts(self) -> list[TextPart | ImageURLPart | VideoURLPart]:
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


class FunctionDefinition(StrictRequestModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments
    strict: bool | None = None


class ChatTool(StrictRequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictRequestModel):
    name: str


class NamedToolChoice(StrictRequestModel):
    type: Literal["function"]
    function: NamedFunction


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


class CompletionRequest(SamplingRequestFields):
    prompt: PromptField
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int | None, Field(ge=1)] = None
    # The top alternatives per token (the sampled token's logprob always comes with them).
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None

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
        if all(isinstance(v, int) for v in value):
            return [list(value)]  # one token-id prompt
        return list(value)

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
