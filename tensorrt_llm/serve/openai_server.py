"""FastAPI app of `trtllm-serve`: OpenAI-compatible chat/text completions over the LLM API.

`build_app(llm, args)` returns the app; `commands/serve.py` runs it under uvicorn. Request
bodies are parsed by hand (not by FastAPI's body binding) so that every malformed body, from
broken JSON to a schema violation, becomes an OpenAI-style 400 that names the problem.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat_utils import check_mm_limits, resolve_messages, to_sampling_params
from .llm_client import LLMClient
from .media import MediaConfig
from .metrics import ServerMetrics
from .openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIBaseModel,
    random_id,
    result_error,
    validation_error_message,
)
from .postprocess_handlers import RequestContext, build_response, drain, stream_response

logger = logging.getLogger(__name__)

Req = TypeVar("Req", bound=OpenAIBaseModel)
# Used when a request gives no max_tokens (clamped to what the context length leaves).
DEFAULT_MAX_TOKENS = 256
_KNOWN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def _abort_unfinished(results: list[Any]) -> None:
    for result in results:
        if not result.finished:
            result.abort()


class _SSEResponse(StreamingResponse):
    """An SSE stream that aborts its requests however it ends.

    NOTE: a stream whose client vanished before the first chunk is cancelled before its
    generator ever runs, so the generator's own `finally` cannot be the only cleanup.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _JSONResponse(JSONResponse):
    # NOTE: ASCII-escaped, so a lone surrogate echoed from a request can never fail encoding.
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(request: Request, model_cls: type[Req]) -> Req:
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"invalid JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise APIError(400, f"request body must be a JSON object, got {kind}", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = validation_error_message(exc)
        raise APIError(400, message, code="invalid_request", param=param) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so only that is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServer:
    """Request handlers plus the state they share (LLM client, metrics, media settings)."""

    def __init__(self, llm: Any, args: argparse.Namespace | Any) -> None:
        self.client = LLMClient(llm, getattr(args, "served_model_name", None))
        self.model_name = self.client.model_name
        root = getattr(args, "allowed_local_media_path", None)
        self.media_config = MediaConfig(
            allowed_local_media_path=Path(root) if root else None,
            fetch_timeout_s=getattr(args, "media_fetch_timeout", None) or 10.0,
            max_media_bytes=getattr(args, "max_media_bytes", None) or 32 * 1024 * 1024,
        )
        self.mm_limits = (
            getattr(args, "limit_mm_per_prompt", None) or self.client.limit_mm_per_prompt
        )
        self.default_max_tokens = getattr(args, "default_max_tokens", None) or DEFAULT_MAX_TOKENS
        self.metrics = ServerMetrics(self.model_name, self.client.stats)
        self.http: httpx.AsyncClient | None = None

    # ---- shared checks -------------------------------------------------------------------------
    def _check_request(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        if body.model != self.model_name:
            raise APIError(
                400,
                f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found",
                param="model",
            )
        unsupported = body.unsupported_features()
        if unsupported:
            raise APIError(400, unsupported, code="unsupported_feature")

    def _max_tokens(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[int, bool]:
        """(max_tokens, whether the client gave it)."""
        given = body.effective_max_tokens
        if given is not None:
            return given, True
        limit = self.client.max_seq_len
        default = self.default_max_tokens if limit is None else min(self.default_max_tokens, limit)
        return max(default, 1), False

    # ---- handlers ------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        self._check_request(body)
        check_mm_limits(body.messages, self.mm_limits)
        assert self.http is not None, "the app's lifespan did not start"
        messages = await resolve_messages(body.messages, self.media_config, self.http)
        return await self._generate(request, body, "chat", [{"prompt": messages}])

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        self._check_request(body)
        prompts: list[Any] = [
            {"prompt_token_ids": p} if isinstance(p, list) else {"prompt": p}
            for p in body.prompts()
        ]
        return await self._generate(request, body, "completion", prompts)

    async def _generate(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        kind: str,
        prompts: list[Any],
    ) -> Response:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        ctx = RequestContext(
            kind=kind,  # type: ignore[arg-type]
            request_id=random_id("chatcmpl" if kind == "chat" else "cmpl"),
            model=self.model_name,
            n=body.n,
            metrics=self.metrics,
            include_usage=include_usage,
        )
        max_tokens, explicit = self._max_tokens(body)
        param = "messages" if kind == "chat" else "prompt"
        results = await self._submit_all(body, prompts, max_tokens, explicit, param)
        if body.stream:
            return _SSEResponse(
                self._count_in_flight(stream_response(ctx, results)),
                on_close=lambda: _abort_unfinished(results),
            )
        self.metrics.on_request_start()
        try:
            if not await self._wait(request, ctx, results):
                return Response(status_code=499)  # nobody is listening; the status is for logs
        finally:
            self.metrics.on_request_end()
        for result in results:
            if result.error:
                raise result_error(result.error, result.error_code)
        return _JSONResponse(build_response(ctx, results).model_dump())

    async def _submit_all(
        self, body: Any, prompts: list[Any], max_tokens: int, explicit: bool, param: str
    ) -> list[Any]:
        params = to_sampling_params(body, max_tokens)
        results: list[Any] = []
        try:
            for prompt in prompts:
                result = await self.client.submit(
                    prompt, params, streaming=bool(body.stream), clamp=not explicit
                )
                results.append(result)
        except BaseException as exc:
            # One bad prompt of several fails the whole request: free the ones already queued.
            _abort_unfinished(results)
            if isinstance(exc, APIError):
                exc.param = exc.param or param
            raise
        return results

    async def _wait(self, request: Request, ctx: RequestContext, results: list[Any]) -> bool:
        """Wait for every result; abort them and return False if the client disconnects."""
        work = asyncio.ensure_future(
            asyncio.gather(*(drain(r, self.metrics, ctx.start) for r in results))
        )
        watch = asyncio.ensure_future(_client_gone(request))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                work.result()
                return True
            return False
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            _abort_unfinished(results)

    async def _count_in_flight(self, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        self.metrics.on_request_start()
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            self.metrics.on_request_end()

    def models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=self.model_name, max_model_len=self.client.max_seq_len)]
        )


def _error_response(exc: APIError) -> _JSONResponse:
    return _JSONResponse(exc.to_response().model_dump(), status_code=exc.status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> _JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> _JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail), code=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> _JSONResponse:
        logger.exception("unhandled error while serving a request")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


class _HttpMetrics:
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
            self.metrics.on_http(path if path in _KNOWN_PATHS else "other", status)


def build_app(llm: Any, args: argparse.Namespace | Any) -> FastAPI:
    """The FastAPI app serving `llm`. The app shuts the LLM down when its lifespan ends."""
    server = OpenAIServer(llm, args)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.http = httpx.AsyncClient(follow_redirects=True, max_redirects=3)
        try:
            yield
        finally:
            await server.http.aclose()
            if getattr(args, "shutdown_llm", True):
                await asyncio.to_thread(server.client.shutdown)

    app = FastAPI(title="trtllm-serve", lifespan=lifespan)
    app.state.server = server
    _install_error_handlers(app)
    app.add_middleware(_HttpMetrics, metrics=server.metrics)

    @app.get("/health")
    async def health() -> Response:
        if server.client.is_shut_down:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> _JSONResponse:
        return _JSONResponse(server.models().model_dump())

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    return app
