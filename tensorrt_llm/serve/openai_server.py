"""`OpenAIServer`: the request handlers of `trtllm-serve`, OpenAI-compatible chat/text
completions over the LLM API. `app.build_app(llm, args)` puts them behind FastAPI routes;
`TrtllmServer`'s shutdown (lifecycle.py) drains the app's requests first. Bodies are read
with a size cap and a deadline and parsed by hand (request_body.py), so every malformed body
is a 4xx.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from ..llmapi.engine_client import EngineClient
from .chat_options import ChatParsers, template_kwargs, template_renders_tools
from .chat_utils import check_mm_limits, resolve_messages, to_sampling_params
from .choice_parsers import ChoiceParsing
from .http_responses import (
    JSONBody,
    SSEResponse,
    abort_unfinished,
)
from .lifecycle import DrainController, until_aborted
from .llm_client import LLMClient
from .logprobs_format import TokenTexts
from .media import MediaConfig
from .metrics import ServerMetrics
from .openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    random_id,
    result_error,
)
from .postprocess_handlers import RequestContext, build_response, drain, sse, stream_response
from .preprocess_pool import PreprocessPool, default_num_workers
from .request_body import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    STATUS_CLIENT_CLOSED,
    BodyLimits,
    parse_body,
)
from .server_args import (
    DEFAULT_MAX_PROMPTS,
    DEFAULT_MAX_SEQUENCES,
    DEFAULT_MM_LIMITS,
    arg_or,
    media_config_from_args,
)

logger = logging.getLogger(__name__)

# Used when a request gives no max_tokens (clamped to what the context length leaves).
DEFAULT_MAX_TOKENS = 256


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so only that is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServer:
    """Request handlers plus the state they share (LLM client, metrics, media settings)."""

    def __init__(self, llm: Any, args: argparse.Namespace | Any) -> None:
        self.media_config = media_config_from_args(args)
        self.pool = _make_pool(
            llm, getattr(args, "num_preprocess_workers", None), self.media_config
        )
        self.client = LLMClient(llm, getattr(args, "served_model_name", None), self.pool)
        self.model_name = self.client.model_name
        self.chat_parsers = ChatParsers(llm, args, self.model_name)
        tokenizer = getattr(llm, "tokenizer", None)
        # The rendered prompt's end (does the template open `<think>`?), for the parsers.
        self._prompt_tail = (
            (lambda ids: tokenizer.decode(ids[-8:])) if tokenizer is not None else None
        )
        self._token_texts = TokenTexts(tokenizer)
        self._tokenizer = tokenizer
        self._renders_tools = template_renders_tools(tokenizer)
        self.mm_limits = getattr(args, "limit_mm_per_prompt", None)
        if self.mm_limits is None:
            self.mm_limits = self.client.limit_mm_per_prompt or dict(DEFAULT_MM_LIMITS)
        self.default_max_tokens = getattr(args, "default_max_tokens", None) or DEFAULT_MAX_TOKENS
        self.body_limits = BodyLimits(
            max_bytes=arg_or(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES),
            read_timeout_s=arg_or(args, "body_read_timeout", DEFAULT_BODY_READ_TIMEOUT_S),
        )
        self.max_prompts = arg_or(args, "max_prompts_per_request", DEFAULT_MAX_PROMPTS)
        self.max_sequences = arg_or(args, "max_sequences_per_request", DEFAULT_MAX_SEQUENCES)
        self.metrics = ServerMetrics(self.model_name, self.client.stats)
        self.drain = DrainController()
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
        return await self._guarded(self._chat_completions(request))

    async def completions(self, request: Request) -> Response:
        return await self._guarded(self._completions(request))

    async def _guarded(self, handler: Any) -> Response:
        """Run a generation handler as one in-flight request of the shutdown drain.

        A streaming response keeps the count until its stream closes."""
        if self.drain.draining:
            handler.close()
            raise APIError(503, "the server is shutting down", code="shutting_down")
        self.drain.in_flight += 1
        handed_over = False
        try:
            response = await handler
            if isinstance(response, SSEResponse):
                response.add_close_hook(self._stream_closed)
                handed_over = True
            return response
        finally:
            if not handed_over:
                self.drain.in_flight -= 1

    def _stream_closed(self) -> None:
        self.drain.in_flight -= 1

    async def _chat_completions(self, request: Request) -> Response:
        start = time.perf_counter()
        body = await parse_body(request, ChatCompletionRequest, self.body_limits)
        parsed = time.perf_counter()
        self.metrics.on_stage("parse", parsed - start)
        self._check_request(body)
        parsing = self.chat_parsers.for_request(body)  # a bad tool_choice: before any fetch
        check_mm_limits(body.messages, self.mm_limits)
        assert self.http is not None, "the app's lifespan did not start"
        # With a preprocess pool the media are decoded in its workers, not here.
        decode = self.pool is None
        messages = await resolve_messages(body.messages, self.media_config, self.http, decode)
        self.metrics.on_stage("media", time.perf_counter() - parsed)
        prompt: dict[str, Any] = {"prompt": messages}
        kwargs = template_kwargs(body, parsing.forced, self._renders_tools)
        if kwargs:
            prompt["chat_template_kwargs"] = kwargs
        if body.cache_salt is not None:
            prompt["cache_salt"] = body.cache_salt
        return await self._generate(request, body, "chat", [prompt], start, parsing)

    async def _completions(self, request: Request) -> Response:
        start = time.perf_counter()
        body = await parse_body(request, CompletionRequest, self.body_limits)
        self.metrics.on_stage("parse", time.perf_counter() - start)
        self._check_request(body)
        prompts: list[Any] = [
            {"prompt_token_ids": p} if isinstance(p, list) else {"prompt": p}
            for p in body.prompts()
        ]
        if body.cache_salt is not None:
            for prompt in prompts:
                prompt["cache_salt"] = body.cache_salt
        self._check_request_size(len(prompts), body.n)
        return await self._generate(request, body, "completion", prompts, start)

    def _prompt_text(self, result: Any) -> str:
        """What echo prepends: the prompt string as given, or a token-id prompt decoded (as
        vLLM does)."""
        if result.prompt is not None:
            return str(result.prompt)
        if self._tokenizer is None:
            return ""
        return str(self._tokenizer.decode(list(result.prompt_token_ids)))

    def _check_request_size(self, num_prompts: int, n: int) -> None:
        if num_prompts > self.max_prompts:
            raise APIError(
                400,
                f"{num_prompts} prompts in one request; this server allows at most "
                f"{self.max_prompts} (--max_prompts_per_request)",
                code="too_many_prompts",
                param="prompt",
            )
        if num_prompts * n > self.max_sequences:
            raise APIError(
                400,
                f"{num_prompts} prompts x n={n} asks for {num_prompts * n} sequences; this "
                f"server allows at most {self.max_sequences} per request "
                f"(--max_sequences_per_request)",
                code="too_many_sequences",
                param="n",
            )

    async def _generate(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        kind: str,
        prompts: list[Any],
        start: float,
        parsing: ChoiceParsing | None = None,
    ) -> Response:
        """start: when the handler began (TTFT is measured from there); parsing: how chat
        outputs are split into content, reasoning and tool calls."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        ctx = RequestContext(
            kind=kind,  # type: ignore[arg-type]
            request_id=random_id("chatcmpl" if kind == "chat" else "cmpl"),
            model=self.model_name,
            n=body.n,
            metrics=self.metrics,
            include_usage=include_usage,
            start=start,
            parsing=parsing if parsing is not None and parsing.active else None,
            prompt_tail=self._prompt_tail,
            logprobs=body.num_logprobs,
            token_texts=self._token_texts,
            echo=bool(getattr(body, "echo", False)),
            echo_text=self._prompt_text,
            prompt_logprobs=body.prompt_logprobs is not None,
        )
        max_tokens, explicit = self._max_tokens(body)
        param = "messages" if kind == "chat" else "prompt"
        preparing = time.perf_counter()
        results = await self._submit_all(body, prompts, max_tokens, explicit, param, ctx)
        ctx.submitted = time.perf_counter()
        self.metrics.on_stage("prepare", ctx.submitted - preparing)
        if body.stream:
            return SSEResponse(
                self._count_in_flight(stream_response(ctx, results), results),
                on_close=lambda: abort_unfinished(results),
            )
        self.metrics.on_request_start()
        try:
            if not await self._wait(request, ctx, results):
                # Nobody is listening; the status is for the logs and the http metric.
                return Response(status_code=STATUS_CLIENT_CLOSED)
        finally:
            self.metrics.on_request_end()
        for result in results:
            if result.error:
                raise result_error(result.error, result.error_code)
        return JSONBody(build_response(ctx, results).model_dump())

    async def _submit_all(
        self,
        body: Any,
        prompts: list[Any],
        max_tokens: int,
        explicit: bool,
        param: str,
        ctx: RequestContext,
    ) -> list[Any]:
        params = to_sampling_params(body, max_tokens, self.chat_parsers.tool_parser)
        results: list[Any] = []
        try:
            for prompt in prompts:
                result = await self.client.submit(
                    prompt,
                    params,
                    streaming=bool(body.stream),
                    clamp=not explicit,
                    scheduling_group=ctx.request_id,
                )
                results.append(result)
        except BaseException as exc:
            # One bad prompt of several fails the whole request: free the ones already queued.
            abort_unfinished(results)
            if isinstance(exc, APIError):
                exc.param = exc.param or param
            raise
        return results

    async def _wait(self, request: Request, ctx: RequestContext, results: list[Any]) -> bool:
        """Wait for every result; abort them and return False if the client disconnects.

        Raises APIError(503) when the shutdown's abort phase comes first."""
        work = asyncio.ensure_future(asyncio.gather(*(drain(r, ctx) for r in results)))
        # NOTE: a cancelled or failed gather nobody awaits would log "exception was never
        # retrieved" once per disconnect; this callback retrieves it.
        work.add_done_callback(_retrieve)
        watch = asyncio.ensure_future(_client_gone(request))
        shutdown = asyncio.ensure_future(self.drain.abort_event.wait())
        try:
            done, _ = await asyncio.wait(
                {work, watch, shutdown}, return_when=asyncio.FIRST_COMPLETED
            )
            if work in done:
                work.result()
                return True
            if shutdown in done:
                raise APIError(
                    503,
                    "the server shut down before this request finished",
                    code="shutting_down",
                )
            return False
        finally:
            watch.cancel()
            shutdown.cancel()
            if not work.done():
                work.cancel()
            abort_unfinished(results)

    async def _count_in_flight(
        self, stream: AsyncIterator[str], results: list[Any]
    ) -> AsyncIterator[str]:
        self.metrics.on_request_start()
        try:
            async for event in until_aborted(stream, self.drain):
                if event is None:  # the shutdown's abort phase: say so, then end the stream
                    abort_unfinished(results)
                    error = APIError(
                        503,
                        "the server shut down before this request finished",
                        code="shutting_down",
                    )
                    yield sse(error.to_response().model_dump_json())
                    yield sse("[DONE]")
                    return
                yield event
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            self.metrics.on_request_end()

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, max_model_len=self.client.max_seq_len)

    def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    def model(self, model_id: str) -> ModelCard:
        """GET /v1/models/{id}: this server's card, or OpenAI's 404 for any other id."""
        if model_id != self.model_name:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found",
                param="model",
            )
        return self.model_card()


def _make_pool(
    llm: Any, num_workers: int | None, media_config: MediaConfig
) -> PreprocessPool | None:
    """The preprocess pool for a real LLM (None: input processing on the server's threads)."""
    if not isinstance(llm, EngineClient):
        if num_workers:
            raise ValueError("--num_preprocess_workers needs a real LLM")
        return None
    args, max_seq_len = llm.preparer_spec()
    if num_workers is None:
        num_workers = default_num_workers(args.resolve_device().type)
    if num_workers < 0:
        raise ValueError(f"num_preprocess_workers must be >= 0, got {num_workers}")
    if not num_workers:
        return None
    return PreprocessPool(args, max_seq_len, num_workers, media_config)
