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


# Errors saying a value is not of one union member's type: noise when another member's error
# goes deeper into the value (a content list with a bad part is "not a string" too).
_BRANCH_MISMATCH = frozenset(
    {
        "string_type",
        "list_type",
        "dict_type",
        "model_type",
        "model_attributes_type",
        "none_required",
        "int_type",
        "int_parsing",
        "float_type",
        "float_parsing",
        "bool_type",
        "bool_parsing",
    }
)


def _field_path(loc: tuple[int | str, ...]) -> str:
    """The dotted path of `loc` without pydantic's union-member labels ("str", "ImageURL",
    "list[...]", and a tagged union's label with the tag after it)."""
    parts: list[str] = []
    tag_at = -1  # the index in `loc` of a tagged union's tag
    for i, part in enumerate(loc):
        if i == tag_at:
            continue
        if isinstance(part, str):
            if "tagged-union[" in part:
                # "list[tagged-union[...]]" is followed by the element index, then the tag.
                tag_at = i + (1 if part.startswith("tagged-union[") else 2)
                continue
            # NOTE: request fields are lower-case names; labels are types (capitalised, or
            # a builtin, or a generic like list[int]).
            if "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool"):
                continue
        parts.append(str(part))
    return ".".join(parts)


def validation_error_message(exc: ValidationError, max_errors: int = 3) -> tuple[str, str | None]:
    """A readable one-line message and the `param` (dotted path) of the first error."""
    errors = exc.errors(include_url=False)
    located = [(_field_path(tuple(e.get("loc", ()))), e) for e in errors]
    deeper = [
        (path, e)
        for path, e in located
        if e.get("type") not in _BRANCH_MISMATCH
        or not any(other.startswith(path + ".") for other, _ in located)
    ]
    located = deeper or located
    parts = []
    first_param = None
    seen: set[str] = set()
    for loc, err in located:
        # pydantic prefixes a validator's ValueError with "Value error, ".
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        line = f"{loc}: {msg}" if loc else msg
        if line in seen:
            continue
        seen.add(line)
        if first_param is None and loc:
            first_param = loc
        parts.append(line)
    more = len(parts) - max_errors
    parts = parts[:max_errors]
    if more > 0:
        parts.append(f"... and {more} more error(s)")
    return "invalid request: " + "; ".join(parts), first_param
