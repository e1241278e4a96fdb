"""Drive our LLM API with a workload at a fixed concurrency and time every request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..sampling_params import SamplingParams
from .metrics import RequestTiming, summarize
from .workload import Workload


def sampling_params(workload: Workload, osl: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=osl or workload.osl,
        temperature=0.0,
        ignore_eos=workload.ignore_eos,
        detokenize=False,
    )


async def _one(llm: Any, prompt: dict[str, Any], params: SamplingParams) -> RequestTiming:
    start = time.perf_counter()
    first = None
    count = 0
    async for out in llm.generate_async(prompt, params, streaming=True):
        count = len(out.outputs[0].token_ids)
        if first is None and count:
            first = time.perf_counter()
    end = time.perf_counter()
    return RequestTiming(start, first if first is not None else end, end, count)


async def _run_all(
    llm: Any, prompts: list[dict[str, Any]], params: SamplingParams, concurrency: int
) -> list[RequestTiming]:
    gate = asyncio.Semaphore(concurrency)

    async def guarded(prompt: dict[str, Any]) -> RequestTiming:
        async with gate:
            return await _one(llm, prompt, params)

    return list(await asyncio.gather(*(guarded(p) for p in prompts)))


def run_concurrency(
    llm: Any, prompts: list[dict[str, Any]], workload: Workload, concurrency: int
) -> dict[str, float]:
    params = sampling_params(workload)
    start = time.perf_counter()
    timings = asyncio.run(_run_all(llm, prompts, params, concurrency))
    return summarize(timings, time.perf_counter() - start, concurrency)


def warm_up(llm: Any, prompts: list[dict[str, Any]], workload: Workload) -> None:
    """A few short requests first, so autotuning and graph capture stay out of the timings."""
    params = sampling_params(workload, osl=8)
    asyncio.run(_run_all(llm, prompts[:4], params, 4))
