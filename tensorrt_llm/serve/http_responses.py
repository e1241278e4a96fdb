"""HTTP plumbing of the app: response classes, error handlers, and the status-code metric.

Kept apart from the request handlers (openai_server.py) so each file holds one concept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import ServerMetrics
from .openai_protocol import APIError

logger = logging.getLogger(__name__)

# Paths the http metric names; anything else is counted as "other".
KNOWN_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/version",
)
# /v1/models/{id} is counted under one label: the ids come from clients.
MODEL_PATH_PREFIX = "/v1/models/"
# A logged error message is cut here, so a message echoing a request stays one short line.
_MAX_LOGGED_MESSAGE = 300


def abort_unfinished(results: list[Any]) -> None:
    for result in results:
        if not result.finished:
            result.abort()


class SSEResponse(StreamingResponse):
    """An SSE stream that aborts its requests however it ends.

    NOTE: a stream whose client vanished before the first chunk is cancelled before its
    generator ever runs, so the generator's own `finally` cannot be the only cleanup.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = [on_close]

    def add_close_hook(self, hook: Callable[[], None]) -> None:
        self._on_close.append(hook)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for hook in self._on_close:
                hook()


class JSONBody(JSONResponse):
    # NOTE: ASCII-escaped, so a lone surrogate echoed from a request can never fail encoding.
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(exc: APIError, headers: Mapping[str, str] | None = None) -> JSONBody:
    """headers: kept from a router error (a 405's Allow)."""
    return JSONBody(exc.to_response().model_dump(), status_code=exc.status, headers=headers)


def log_error_reason(request: Request, exc: APIError) -> None:
    """One line per error answer: a client error (4xx) at INFO, so an operator sees why a
    request was refused; a server-side one (5xx) at WARNING. The body is never logged."""
    message = exc.message.replace("\r", "\\r").replace("\n", "\\n")
    if len(message) > _MAX_LOGGED_MESSAGE:
        message = message[:_MAX_LOGGED_MESSAGE] + "..."
    level = logging.INFO if exc.status < 500 else logging.WARNING
    logger.log(level, "%s %s %d: %s", request.method, request.url.path, exc.status, message)


def served_routes(app: FastAPI) -> list[str]:
    """'METHOD /path' of each API route (FastAPI's own docs pages left out)."""
    return [
        f"{method} {route.path_format}"
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in sorted(route.methods or ())
    ]


def routing_error(request: Request, exc: StarletteHTTPException, routes: list[str]) -> APIError:
    """The router's 404 / 405 saying what this server does serve (vLLM routes such as
    /v1/embeddings or /tokenize are not here); any other HTTPException as it is."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return APIError(
            404, f"no route {where}; this server serves {', '.join(routes)}", code="not_found"
        )
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return APIError(
            405,
            f"method {request.method} is not allowed on {request.url.path}; use {allowed}",
            code="method_not_allowed",
        )
    return APIError(exc.status_code, str(exc.detail), code=exc.status_code)  # type: ignore[arg-type]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONBody:
        log_error_reason(request, exc)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONBody:
        error = routing_error(request, exc, served_routes(app))
        log_error_reason(request, error)
        return error_response(error, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONBody:
        logger.exception("unhandled error while serving a request")
        # NOTE: the details stay in the log; a client learns nothing about the internals.
        return error_response(APIError(500, "internal server error (see the server log)"))


class HttpMetrics:
    """Pure ASGI middleware counting responses by path and status (keeps disconnect semantics
    of streaming responses intact, unlike BaseHTTPMiddleware)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_record(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            path = scope.get("path", "")
            if path.startswith(MODEL_PATH_PREFIX):
                label = MODEL_PATH_PREFIX + "{id}"
            else:
                label = path if path in KNOWN_PATHS else "other"
            self.metrics.on_http(label, status)
