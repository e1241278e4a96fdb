"""Reading and parsing request bodies, with a size cap and a total read deadline.

Bodies are read by hand (not by FastAPI's body binding) so that every malformed body, from
broken JSON to a schema violation, becomes an OpenAI-style 400 that names the problem, and so
that an oversized or trickled body is refused without holding it all in memory first.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from .openai_protocol import (
    APIError,
    OpenAIBaseModel,
    SamplingRequestFields,
    validation_error_message,
)
from .request_fields import check_request_fields

Req = TypeVar("Req", bound=OpenAIBaseModel)

DEFAULT_MAX_REQUEST_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_READ_TIMEOUT_S = 60.0
# Not an HTTP status a client will see (it is gone); nginx's convention, so logs and the
# http_requests metric count a client that left mid-request as a cancellation, not a 5xx.
STATUS_CLIENT_CLOSED = 499


class ClientClosedRequest(APIError):
    """The client disconnected before its request body was complete."""

    def __init__(self) -> None:
        super().__init__(STATUS_CLIENT_CLOSED, "client disconnected", code="client_disconnected")


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_bytes}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"body read timeout must be positive, got {self.read_timeout_s}")


def _too_large(limits: BodyLimits) -> APIError:
    return APIError(
        413,
        f"request body is larger than {limits.max_bytes} bytes (--max_request_body_bytes)",
        code="request_too_large",
    )


async def _read_chunks(request: Request, limits: BodyLimits) -> bytes:
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limits.max_bytes:
            raise _too_large(limits)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The whole body, or APIError: 413 over the cap (checked against Content-Length before
    reading), 408 past the total read deadline, ClientClosedRequest if the client left."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(400, "invalid Content-Length header", code="invalid_request")
        if int(declared) > limits.max_bytes:
            raise _too_large(limits)
    try:
        # NOTE: one deadline for the whole body, not per read: a client trickling a byte at a
        # time must not hold a worker for longer than this.
        return await asyncio.wait_for(_read_chunks(request, limits), limits.read_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"request body not received within {limits.read_timeout_s:g} s",
            code="request_timeout",
        ) from None
    except ClientDisconnect:
        raise ClientClosedRequest() from None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(request: Request, model_cls: type[Req], limits: BodyLimits) -> Req:
    raw = await read_body(request, limits)
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"invalid JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise APIError(400, f"request body must be a JSON object, got {kind}", code="invalid_json")
    if issubclass(model_cls, SamplingRequestFields):  # a 400 for anything it would ignore
        data = check_request_fields(data, frozenset(model_cls.model_fields))
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = validation_error_message(exc)
        raise APIError(400, message, code="invalid_request", param=param) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None
