"""The FastAPI app of `trtllm-serve`: the routes and the lifespan around one `OpenAIServer`
(openai_server.py holds the request handlers). `build_app(llm, args)` returns the app;
`commands/serve.py` runs it under `TrtllmServer` (lifecycle.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from .. import __version__
from .http_responses import HttpMetrics, JSONBody, install_error_handlers
from .lifecycle import monitor_loop_lag
from .media import make_media_http_client
from .openai_server import OpenAIServer

logger = logging.getLogger(__name__)


def build_app(llm: Any, args: argparse.Namespace | Any) -> FastAPI:
    """The FastAPI app serving `llm`. The app shuts the LLM down when its lifespan ends."""
    server = OpenAIServer(llm, args)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.http = make_media_http_client(server.media_config)
        lag = asyncio.ensure_future(monitor_loop_lag(server.metrics.set_event_loop_lag))
        if server.pool is not None:
            await server.pool.start()
            logger.info("input preprocessing: %d worker processes", server.pool.num_workers)
        try:
            yield
        finally:
            lag.cancel()
            await server.http.aclose()
            if server.pool is not None:
                await asyncio.to_thread(server.pool.shutdown)
            if getattr(args, "shutdown_llm", True):
                await asyncio.to_thread(server.client.shutdown)

    app = FastAPI(title="trtllm-serve", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    app.add_middleware(HttpMetrics, metrics=server.metrics)

    @app.get("/health")
    async def health() -> Response:
        if server.client.is_shut_down:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONBody:
        return JSONBody(server.models().model_dump())

    # NOTE: ids may contain "/" (e.g. Qwen/Qwen3-VL-8B-Instruct), hence the path converter.
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONBody:
        return JSONBody(server.model(model_id).model_dump())

    @app.get("/version")
    async def version() -> JSONBody:
        return JSONBody({"version": __version__})

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
