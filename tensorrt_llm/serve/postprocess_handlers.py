"""Generation results -> OpenAI responses: whole responses, and SSE streams of chunks.

Each HTTP request owns one or more `GenerationResult`s (a completion request may carry several
prompts). `track` consumes a result's updates, feeding the TTFT / ITL metrics as tokens land;
both the streaming and the non-streaming paths go through it, so the metrics mean the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic_core

from .choice_parsers import ChoiceParser, ChoiceParsing, MessageDelta
from .logprobs_format import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_completion_logprobs,
    prompt_logprobs_json,
)
from .metrics import ServerMetrics
from .openai_protocol import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    UsageInfo,
    result_error,
)
from .openai_responses import PromptTokensDetails

# The executor's "cancelled" has no OpenAI spelling; only aborted (disconnected) requests see it.
_FINISH_REASON = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


@dataclass
class RequestContext:
    """What the response builders need to know about one HTTP request."""

    kind: Literal["chat", "completion"]
    request_id: str
    model: str
    n: int
    metrics: ServerMetrics
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    start: float = field(default_factory=time.perf_counter)  # the handler began (TTFT origin)
    submitted: float | None = None  # every prompt is in the engine's queue
    # Chat outputs split into content / reasoning / tool calls (None: content is the text).
    parsing: ChoiceParsing | None = None
    # Token ids -> text, for the end of the rendered prompt (does it open `<think>`?).
    prompt_tail: Callable[[list[int]], str] | None = None
    # The request's SamplingParams.logprobs (None: no logprobs in the response) and the token
    # strings they are shown with.
    logprobs: int | None = None
    token_texts: TokenTexts | None = None
    # Completions' echo: the prompt's text (`echo_text` of a result) leads each choice's text,
    # and with logprobs the prompt tokens' entries lead its logprobs.
    echo: bool = False
    echo_text: Callable[[Any], str] | None = None
    # The request's own prompt_logprobs: vLLM's `prompt_logprobs` list in the response.
    prompt_logprobs: bool = False

    def prompt_logprobs_of(self, result: Any) -> Any:
        """The response's `prompt_logprobs` for `result` (None when not asked for)."""
        if not self.prompt_logprobs or result.prompt_logprobs is None:
            return None
        assert self.token_texts is not None
        return prompt_logprobs_json(result.prompt_logprobs, self.token_texts)

    def echoed(self, result: Any) -> str:
        return self.echo_text(result) if self.echo_text is not None else ""

    def echo_logprobs(self, result: Any, entries: list[Any]) -> tuple[Any, int]:
        """Completion logprobs of the echoed prompt, then of `entries` (offsets running on)."""
        if self.logprobs is None or self.token_texts is None:
            return None, 0
        ids = result.prompt_token_ids
        prompt = result.prompt_logprobs or [None] * len(ids)  # none: it failed first
        head, offset = echo_completion_logprobs(ids, prompt, self.logprobs, self.token_texts)
        tail, offset = completion_logprobs(entries, self.token_texts, offset)
        return {key: head[key] + tail[key] for key in head}, offset

    def choice_parser(self, result: Any) -> ChoiceParser | None:
        if self.parsing is None:
            return None
        tail = self.prompt_tail(list(result.prompt_token_ids)) if self.prompt_tail else ""
        return self.parsing.parser(tail)

    def whole_logprobs(self, output: Any) -> Any:
        """A whole response's choice logprobs (None when the request asked for none)."""
        return None if self.logprobs is None else self.choice_logprobs(output.logprobs)[0]

    def choice_logprobs(self, entries: list[Any], text_offset: int = 0) -> tuple[Any, int]:
        """(the choice's logprobs object or None, the completion text offset after them)."""
        if self.logprobs is None or self.token_texts is None:
            return None, text_offset
        if self.kind == "chat":
            return chat_logprobs(entries, self.logprobs, self.token_texts), text_offset
        return completion_logprobs(entries, self.token_texts, text_offset)


def _usage(results: list[Any]) -> UsageInfo:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(o.token_ids) for r in results for o in r.outputs)
    cached = sum(getattr(r, "num_cached_tokens", 0) for r in results)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _FINISH_REASON.get(reason, reason)


class _Timing:
    """TTFT / ITL bookkeeping of one result."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.last: float | None = None

    def update(self, metrics: ServerMetrics, num_new: int) -> None:
        if num_new <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            metrics.on_first_token(now - self.ctx.start)
            if self.ctx.submitted is not None:
                metrics.on_stage("first_token", now - self.ctx.submitted)
            num_new -= 1  # the first token has no inter-token gap
        else:
            metrics.on_tokens(now - self.last, num_new)
        self.last = now


async def track(result: Any, ctx: RequestContext) -> AsyncIterator[tuple[Any, list[int]]]:
    """Yield (snapshot, new token count per output) for each update; record metrics."""
    metrics = ctx.metrics
    timing = _Timing(ctx)
    seen = [0] * len(result.outputs)
    async for snapshot in result:
        counts = [len(o.token_ids) - seen[i] for i, o in enumerate(snapshot.outputs)]
        seen = [len(o.token_ids) for o in snapshot.outputs]
        timing.update(metrics, sum(counts))
        yield snapshot, counts
    if result.metrics is not None:
        metrics.on_engine_metrics(result.metrics)
    metrics.on_request_done(
        (o.finish_reason for o in result.outputs),
        len(result.prompt_token_ids),
        sum(len(o.token_ids) for o in result.outputs),
        time.perf_counter() - ctx.start,
    )


async def drain(result: Any, ctx: RequestContext) -> Any:
    async for _ in track(result, ctx):
        pass
    return result


# ---------------------------------------------------------------- whole responses


def build_response(
    ctx: RequestContext, results: list[Any]
) -> ChatCompletionResponse | CompletionResponse:
    usage = _usage(results)
    if ctx.kind == "chat":
        choices = [
            _chat_choice(ctx, results[0], j, out) for j, out in enumerate(results[0].outputs)
        ]
        return ChatCompletionResponse(
            id=ctx.request_id,
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            usage=usage,
            prompt_logprobs=ctx.prompt_logprobs_of(results[0]),
        )
    choices_c = [
        _completion_choice(ctx, result, i * ctx.n + j, out)
        for i, result in enumerate(results)
        for j, out in enumerate(result.outputs)
    ]
    return CompletionResponse(
        id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices_c, usage=usage
    )


def _completion_choice(ctx: RequestContext, result: Any, index: int, out: Any) -> CompletionChoice:
    text, logprobs = out.text, ctx.whole_logprobs(out)
    if ctx.echo:
        text = ctx.echoed(result) + text
        if logprobs is not None:
            logprobs = ctx.echo_logprobs(result, out.logprobs)[0]
    return CompletionChoice(
        index=index,
        text=text,
        finish_reason=_finish_reason(out.finish_reason),
        logprobs=logprobs,
        prompt_logprobs=ctx.prompt_logprobs_of(result),
    )


def _chat_choice(ctx: RequestContext, result: Any, index: int, out: Any) -> ChatCompletionChoice:
    parser = ctx.choice_parser(result)
    reason = _finish_reason(out.finish_reason)
    if parser is None:
        message = ChatResponseMessage(content=out.text)
    else:
        fields = parser.whole(out.text)
        message = ChatResponseMessage(
            content=fields.content,
            reasoning_content=fields.reasoning_content,
            tool_calls=fields.tool_calls or None,
        )
        reason = parser.finish_reason(reason)
    logprobs = ctx.whole_logprobs(out)
    return ChatCompletionChoice(
        index=index, message=message, finish_reason=reason, logprobs=logprobs
    )


# ---------------------------------------------------------------- streams


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _chunk_json(
    ctx: RequestContext, choices: list[dict[str, Any]], usage: UsageInfo | None = None
) -> str:
    """One stream chunk, exactly as `ChatCompletionChunk` / `CompletionResponse` would dump it
    (a test holds the two equal).

    NOTE: built from plain dicts and serialised by pydantic-core's own encoder: constructing
    and validating three models per chunk of every stream was a measurable share of the
    server's per-token time at high concurrency.
    """
    chunk: dict[str, Any] = {
        "id": ctx.request_id,
        "object": "chat.completion.chunk" if ctx.kind == "chat" else "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
    }
    # OpenAI sends "usage": null on every chunk only when include_usage was asked for.
    if ctx.include_usage:
        chunk["usage"] = None if usage is None else usage.model_dump()
    return pydantic_core.to_json(chunk).decode()


def _delta_choice(
    ctx: RequestContext,
    index: int,
    text: str,
    reason: str | None,
    role: str | None = None,
    fields: MessageDelta | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streamed choice (`ChatStreamChoice` / `CompletionChoice` fields, in their order);
    `fields`: a parsed chat delta instead of plain `text`; `logprobs`: the chunk's tokens'
    (`RequestContext.choice_logprobs`)."""
    if ctx.kind == "chat":
        if fields is None:
            fields = MessageDelta(content=text if (text or role) else None)
        delta = {
            "role": role,
            "content": fields.content,
            "reasoning_content": fields.reasoning_content,
            "tool_calls": fields.tool_calls or None,
        }
        return {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
    choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
    choice["prompt_logprobs"] = None  # never streamed (the request model refuses that)
    return choice


async def _merge(results: list[Any], ctx: RequestContext) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, snapshot) from every result, in arrival order."""
    if len(results) == 1:
        async for snapshot, _ in track(results[0], ctx):
            yield 0, snapshot
        return
    queue: asyncio.Queue[tuple[int, Any] | None] = asyncio.Queue()

    async def pump(i: int, result: Any) -> None:
        try:
            async for snapshot, _ in track(result, ctx):
                await queue.put((i, snapshot))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(results)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield item
        for task in tasks:
            task.result()  # surface a pump failure
    finally:
        for task in tasks:
            task.cancel()


async def stream_response(ctx: RequestContext, results: list[Any]) -> AsyncIterator[str]:
    """SSE events of a streamed response; aborts every unfinished result when closed early."""
    try:
        if ctx.kind == "chat":
            first = [_delta_choice(ctx, j, "", None, role="assistant") for j in range(ctx.n)]
            yield sse(_chunk_json(ctx, first))
        sent: dict[int, int] = {}
        # Per choice: logprob entries sent, and the completion text offset reached.
        sent_lp: dict[int, tuple[int, int]] = {}
        done: set[int] = set()
        echoed: set[int] = set()  # choices whose echoed prompt went out
        parsers: dict[int, ChoiceParser | None] = {}
        async for i, snapshot in _merge(results, ctx):
            choices = []
            for j, out in enumerate(snapshot.outputs):
                index = i * ctx.n + j
                echo = ctx.echo and index not in echoed
                if echo and ctx.logprobs is not None and snapshot.prompt_logprobs is None:
                    if not snapshot.finished:
                        # The prompt's logprobs come with the first completion's first token:
                        # this choice waits for them (its text keeps accumulating).
                        continue
                    # The result ended without them (its first completion failed before the
                    # prompt ran): the echo goes out with null prompt entries.
                text = out.text[sent.get(index, 0) :]
                sent[index] = len(out.text)
                reason = _finish_reason(out.finish_reason) if index not in done else None
                if out.finished:
                    done.add(index)
                logprobs = None
                count, offset = sent_lp.get(index, (0, 0))
                if ctx.logprobs is not None and len(out.logprobs) > count:
                    logprobs, offset = ctx.choice_logprobs(out.logprobs[count:], offset)
                    sent_lp[index] = (len(out.logprobs), offset)
                if echo:  # the first chunk of the choice leads with the prompt
                    echoed.add(index)
                    text = ctx.echoed(results[i]) + text
                    if ctx.logprobs is not None:
                        logprobs, offset = ctx.echo_logprobs(snapshot, out.logprobs[count:])
                        sent_lp[index] = (len(out.logprobs), offset)
                if index not in parsers:
                    parsers[index] = ctx.choice_parser(results[i])
                parser = parsers[index]
                if parser is None:
                    if text or reason is not None or logprobs is not None:
                        choices.append(_delta_choice(ctx, index, text, reason, logprobs=logprobs))
                    continue
                fields = parser.feed(text) if text else MessageDelta()
                if reason is not None:
                    fields = fields.merge(parser.finish())
                    reason = parser.finish_reason(reason)
                if not fields.is_empty or reason is not None or logprobs is not None:
                    choices.append(
                        _delta_choice(ctx, index, text, reason, fields=fields, logprobs=logprobs)
                    )
            if choices:
                yield sse(_chunk_json(ctx, choices))
        failed = [r for r in results if r.error]
        if failed:
            # The status line went out with the first chunk; the error body says what happened.
            error = result_error(failed[0].error, failed[0].error_code)
            yield sse(error.to_response().model_dump_json())
        if ctx.include_usage:
            yield sse(_chunk_json(ctx, [], usage=_usage(results)))
        yield sse("[DONE]")
    finally:
        # NOTE: runs on client disconnect too (the stream task is cancelled): the executor
        # must free the seq slot and KV blocks of requests nobody is reading anymore.
        for result in results:
            if not result.finished:
                result.abort()
