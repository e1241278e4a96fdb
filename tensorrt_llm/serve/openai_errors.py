"""The OpenAI-compatible API's errors: the error body models, `APIError` (what handlers raise;
the app turns it into that body), the HTTP status of an executor error code, and a readable
message for a request that failed validation.
"""

from __future__ import annotations

from pydantic import ValidationError

from .._torch.pyexecutor.llm_request import (
    ERROR_INVALID_INPUT,
    ERROR_PROMPT_TOO_LONG,
    ERROR_SHUTTING_DOWN,
)
from .protocol_base import OpenAIBaseModel


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
