"""Drive our LLM API with a workload at a fixed concurrency and time every request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from ..guided_decoding_params import GuidedDecodingParams
from ..sampling_params import SamplingParams
from .metrics import RequestTiming, summarize, timeline_lines
from .profile_env import append_profile_lines, profiled
from .workload import Workload


def sampling_params(workload: Workload, osl: int | None = None) -> SamplingParams:
    guided = GuidedDecodingParams(json=workload.guided_json) if workload.guided_json else None
    return SamplingParams(
        max_tokens=osl or workload.osl,
        temperature=0.0,
        ignore_eos=workload.ignore_eos,
        detokenize=False,
        guided_decoding=guided,
    )


async def _one(llm: Any, prompt: dict[str, Any], params: SamplingParams) -> RequestTiming:
    start = time.perf_counter()
    first = None
    count = 0
    metrics = None
    async for out in llm.generate_async(prompt, params, streaming=True):
        count = len(out.outputs[0].token_ids)
        if first is None and count:
            first = time.perf_counter()
        metrics = out.metrics
    end = time.perf_counter()
    return RequestTiming(start, first if first is not None else end, end, count, metrics=metrics)


async def _run_all(
    llm: Any,
    prompts: list[dict[str, Any]],
    params: SamplingParams | Sequence[SamplingParams],
    concurrency: int,
    bar: tqdm | None = None,
) -> list[RequestTiming]:
    """Every prompt, at most `concurrency` in flight; `params` is one for all or one per prompt
    (a dataset's output lengths differ per request)."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling params")
    gate = asyncio.Semaphore(concurrency)

    async def guarded(prompt: dict[str, Any], p: SamplingParams) -> RequestTiming:
        async with gate:
            timing = await _one(llm, prompt, p)
        if bar is not None:
            bar.update(1)
        return timing

    return list(
        await asyncio.gather(*(guarded(q, p) for q, p in zip(prompts, per_prompt, strict=True)))
    )


def wave_bar(total: int, concurrency: int) -> tqdm:
    """The progress bar of one wave, on stderr; tqdm turns it off where stderr is no terminal
    (logs, CI), so the result tables stay clean there."""
    return tqdm(total=total, desc=f"concurrency {concurrency}", unit="req", disable=None)


def run_requests(
    llm: Any, prompts: list[dict[str, Any]], params: Sequence[SamplingParams], concurrency: int
) -> dict[str, float]:
    """One timed wave of `prompts` with per-prompt `params`, under a progress bar."""
    with wave_bar(len(prompts), concurrency) as bar:
        start = time.perf_counter()
        with profiled(f"concurrency {concurrency}"):
            timings = asyncio.run(_run_all(llm, prompts, params, concurrency, bar))
        wall = time.perf_counter() - start
    append_profile_lines(f"concurrency {concurrency}: requests", timeline_lines(timings, start))
    return summarize(timings, wall, concurrency)


def run_concurrency(
    llm: Any, prompts: list[dict[str, Any]], workload: Workload, concurrency: int
) -> dict[str, float]:
    return run_requests(llm, prompts, [sampling_params(workload)] * len(prompts), concurrency)


def warm_up(llm: Any, prompts: list[dict[str, Any]], workload: Workload) -> None:
    """A few short requests first, so autotuning and graph capture stay out of the timings."""
    params = sampling_params(workload, osl=8)
    asyncio.run(_run_all(llm, prompts[:4], params, 4))


def warm_up_requests(llm: Any, prompts: list[dict[str, Any]], count: int) -> None:
    """`count` short requests of a dataset's prompts (upstream's --warmup), untimed."""
    if count > 0:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
        asyncio.run(_run_all(llm, prompts[:count], params, count))
