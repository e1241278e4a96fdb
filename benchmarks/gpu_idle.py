"""GPU idle time in steady decode, measured on the real serving loop (GPU only).

    python benchmarks/gpu_idle.py --config benchmarks/configs/qwen3_vl_8b.json --concurrency 1 32

For each concurrency it starts that many image+text requests (ISL 1000, long OSL) through the
LLM API, waits until every request has streamed `--settle` tokens (all prefills done, decode
steady), records every device activity for `--window_ms` with the torch profiler, and prints the
share of the window in which no kernel, copy or memset ran, split into the idle time between
CUDA graph replays (the issue's "idle between steps", target < 5%) and the kernel-to-kernel gaps
inside them.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from typing import Any

import torch

from tensorrt_llm.bench.gpu_idle import (
    IdleSummary,
    device_activities,
    split_idle_at_launches,
    summarize_idle,
)
from tensorrt_llm.bench.runner import sampling_params
from tensorrt_llm.bench.workload import Workload, make_requests, prepare_model_folder
from tensorrt_llm.llmapi.llm import LLM


async def _measure(
    llm: LLM, prompts: list[dict[str, Any]], workload: Workload, settle: int, window_ms: float
) -> IdleSummary:
    params = sampling_params(workload)
    counts = [0] * len(prompts)
    done = asyncio.Event()
    results = [llm.generate_async(prompt, params, streaming=True) for prompt in prompts]

    async def one(i: int) -> None:
        async for out in results[i]:
            counts[i] = len(out.outputs[0].token_ids)
        done.set()  # a finished request ends the steady phase

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    while min(counts) < settle:
        if done.is_set():
            raise RuntimeError(f"a request finished before all reached {settle} tokens")
        await asyncio.sleep(0.005)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    profiler.start()
    await asyncio.sleep(window_ms / 1e3)
    profiler.stop()
    finished_early = done.is_set()
    for result in results:  # frees the slots for the next concurrency
        result.abort()
    await asyncio.gather(*tasks)
    if finished_early:
        raise RuntimeError("a request finished inside the window: raise --osl")
    intervals, launch_ids = device_activities(profiler)
    return split_idle_at_launches(summarize_idle(intervals), intervals, launch_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--isl", type=int, default=1000)
    p.add_argument("--osl", type=int, default=1000)
    p.add_argument("--image_size", type=int, default=512)
    p.add_argument("--settle", type=int, default=32, help="tokens per request before measuring")
    p.add_argument("--window_ms", type=float, default=300.0)
    p.add_argument("--quantization", choices=["fp8"], default=None)
    p.add_argument("--kv_cache_dtype", choices=["auto", "fp8"], default="auto")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_idle.py measures CUDA activity and needs a GPU")
    from tensorrt_llm._torch.config_utils import load_pretrained_config

    folder = prepare_model_folder(args.config, tempfile.mkdtemp(), args.image_size)
    config = load_pretrained_config(str(folder))
    llm = LLM(
        model=str(folder),
        load_format="dummy",
        dtype="bfloat16",
        max_batch_size=max(args.concurrency),
        max_num_tokens=8192,
        max_seq_len=args.isl + args.osl + 8,
        kv_cache_free_gpu_memory_fraction=0.8,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    try:
        for c in args.concurrency:
            workload = Workload(args.isl, args.osl, 1, args.image_size, c)
            prompts = make_requests(config, workload)
            summary = asyncio.run(_measure(llm, prompts, workload, args.settle, args.window_ms))
            print(f"concurrency {c}: {summary.format()}", flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
