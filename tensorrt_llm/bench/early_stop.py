"""`--max_tokens_dist LO HI`: requests that reserve a large max_tokens but stop early.

Thinking traces look like this to a scheduler: every request asks for, say, 32k tokens, and
most end after a few thousand. Each request here is sent with max_tokens = `--osl` and stops
after a length drawn uniformly from [LO, HI] (seeded: the same draws every run).

Why a client-side cancel: on random weights no stop token comes at a chosen length, and a
per-request max_tokens would show the scheduler the short length, which is what the benchmark
must not do. So the client cancels the request once it has received its drawn number of tokens:
in process `GenerationResult.abort()` (the path a stop string found on the front end takes),
served by closing the stream (trtllm-serve aborts the requests of a gone client). The engine
handles the cancel at its next step and frees the request's seq slot and KV blocks before its
final response, so from the scheduler's side the request ended a step or two (and, in process,
the `overshoot_tokens_mean` column) after its trace; a served stream has no final response to
count that on. Tokens past the drawn length count neither in the throughput nor in the ITL.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from ..sampling_params import SamplingParams
from .metrics import RequestTiming, summarize
from .peak import LLM_INTERVAL_S, SERVED_INTERVAL_S, PeakSampler, llm_running, served_running
from .served import (
    CHAT_PATH,
    ServedTarget,
    chat_body,
    scrape,
    stage_means,
    stage_sums,
    stream_timing,
)
from .sse_client import StreamResult, post_stream
from .workload import Workload

_SEED_OFFSET = 3  # the draws' own stream: the prompts' generator stays as it is


def draw_stops(low: int, high: int, count: int, seed: int = 0) -> list[int]:
    """`count` stop lengths, uniform over [low, high] inclusive, the same for the same seed."""
    if not 1 <= low <= high:
        raise ValueError(f"--max_tokens_dist needs 1 <= LO <= HI, got {low} {high}")
    rng = np.random.default_rng(seed + _SEED_OFFSET)
    return [int(v) for v in rng.integers(low, high + 1, count)]


def _row(
    timings: list[RequestTiming],
    stops: list[int],
    wall: float,
    concurrency: int,
    peak: int | None,
) -> dict[str, float]:
    row = summarize(timings, wall, concurrency)
    row["stop_tokens_mean"] = float(np.mean(stops))
    row["peak_running"] = float("nan") if peak is None else float(peak)
    return row


# ---- in process --------------------------------------------------------------------------------
async def _llm_one(
    llm: Any, prompt: dict[str, Any], params: SamplingParams, stop: int
) -> tuple[RequestTiming, int]:
    """Stream until `stop` tokens arrived, cancel, and wait for the engine to let go of it;
    (the timing of the first `stop` tokens, the tokens the engine made in all)."""
    start = time.perf_counter()
    first = None
    count = 0
    handle = llm.generate_async(prompt, params, streaming=True)
    async for out in handle:
        count = len(out.outputs[0].token_ids)
        if first is None and count:
            first = time.perf_counter()
        if count >= stop:
            break
    end = time.perf_counter()
    if not handle.finished:
        handle.abort()
        await handle  # the final "cancelled" response: the slot and KV blocks are free by then
    if handle.error:
        raise RuntimeError(f"request failed: {handle.error}")
    made = len(handle.outputs[0].token_ids)
    return RequestTiming(start, first if first is not None else end, end, min(count, stop)), made


async def _llm_all(
    llm: Any, prompts: list[dict[str, Any]], params: SamplingParams, stops: list[int], c: int
) -> list[tuple[RequestTiming, int]]:
    gate = asyncio.Semaphore(c)

    async def guarded(prompt: dict[str, Any], stop: int) -> tuple[RequestTiming, int]:
        async with gate:
            return await _llm_one(llm, prompt, params, stop)

    return list(await asyncio.gather(*(guarded(p, s) for p, s in zip(prompts, stops, strict=True))))


def run_early_stop_llm(
    llm: Any,
    prompts: list[dict[str, Any]],
    params: SamplingParams,
    stops: list[int],
    concurrency: int,
) -> dict[str, float]:
    """One row: throughput and latencies of the stopped traces, the peak of running requests
    and how many tokens past its stop each request ran before the cancel landed (mean)."""
    with PeakSampler(llm_running(llm), LLM_INTERVAL_S) as peak:
        start = time.perf_counter()
        results = asyncio.run(_llm_all(llm, prompts, params, stops, concurrency))
        wall = time.perf_counter() - start
    row = _row([t for t, _ in results], stops, wall, concurrency, peak.peak)
    over = [made - t.num_output_tokens for t, made in results]
    row["overshoot_tokens_mean"] = float(np.mean(over))
    return row


# ---- served --------------------------------------------------------------------------------------
async def _served_all(
    target: ServedTarget, bodies: list[bytes], stops: list[int], c: int
) -> list[StreamResult]:
    gate = asyncio.Semaphore(c)

    async def guarded(body: bytes, stop: int) -> StreamResult:
        async with gate:
            # NOTE: content chunks stand for tokens: each id of the bench tokenizer decodes to
            # text, and the server sends a chunk per engine update (rarely two tokens at once
            # under load, so a served trace may run a little longer than drawn).
            return await post_stream(target.host, target.port, CHAT_PATH, body, stop_after=stop)

    return list(await asyncio.gather(*(guarded(b, s) for b, s in zip(bodies, stops, strict=True))))


def run_early_stop_served(
    target: ServedTarget,
    contents: list[list[dict[str, Any]]],
    workload: Workload,
    stops: list[int],
    concurrency: int,
) -> dict[str, float]:
    """The served row: as in process, plus the server's stage means (no overshoot column)."""
    bodies = [chat_body(target, c, workload.osl, workload.ignore_eos) for c in contents]
    before = stage_sums(scrape(target))
    reader = served_running(target.host, target.port)
    with PeakSampler(reader, SERVED_INTERVAL_S) as peak:
        start = time.perf_counter()
        results = asyncio.run(_served_all(target, bodies, stops, concurrency))
        wall = time.perf_counter() - start
    timings = []
    for res in results:
        timing = stream_timing(res)
        if res.stopped_early:
            timing.num_output_tokens = res.content_chunks  # no usage chunk on a closed stream
        timings.append(timing)
    row = _row(timings, stops, wall, concurrency, peak.peak)
    row["isl_mean"] = float("nan")  # a closed stream reports no usage
    row.update(stage_means(before, stage_sums(scrape(target))))
    return row
