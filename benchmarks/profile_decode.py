"""Where does a decode step's time go? Engine-only timings plus a kernel breakdown (GPU).

    python benchmarks/profile_decode.py --config benchmarks/configs/qwen3_vl_8b.json \
        --batch 1 32 --context 1000

For each batch size: wall time of `engine.forward` (host prepare + graph replay + sync), GPU time
of the replay alone (CUDA events), and the top kernels of one replay from the torch profiler.

`--mixed_chunks 64 256 1024` also times mixed steps (the decode batch plus one text prefill
chunk of that many tokens): wall time per step against the GPU's busy time in it. They run
through the piecewise graphs by default; `--piecewise_max_tokens 0` runs them eagerly (compare
the two: the idle share is the host time the graphs recover).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm.bench.gpu_timing import replay_time_us
from tensorrt_llm.bench.workload import prepare_model_folder
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.llmapi.llm import LLM


def _requests(llm: LLM, batch: int, context: int) -> list[LlmRequest]:
    executor = llm._executor
    engine = executor.model_engine
    reqs = []
    for i in range(batch):
        ids = [(7 * i + j) % 300 for j in range(context)]
        _, extra = llm.input_processor({"prompt_token_ids": ids}, None)
        req = LlmRequest(
            10_000 + i, ids, multimodal_params=MultimodalParams(extra["multimodal_data"])
        )
        req.seq_slot = executor.seq_slot_manager.acquire(req.request_id)
        assert executor.kv_cache_manager.add_tokens(req.request_id, context + 64)
        req.context_chunk_size = context
        engine.forward(ScheduledRequests([req], []))
        req.add_new_token(1)
        reqs.append(req)
    return reqs


def _release(llm: LLM, reqs: list[LlmRequest]) -> None:
    for req in reqs:
        llm._executor.kv_cache_manager.free(req.request_id)
        llm._executor.seq_slot_manager.release(req.request_id)


def _kernel_trace(prof: torch.profiler.profile, count: int) -> None:
    """The step's first `count` kernels in launch order with their GPU times: with the layer's
    kernel order fixed, this attributes time to each projection (the summary table merges every
    launch of a kernel). Run with TRTLLM_PDL=0: under PDL a kernel's time includes its wait."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    print(f"first {count} of {len(kernels)} kernels (us):")
    for e in kernels[:count]:
        print(f"  {e.time_range.elapsed_us():8.1f}  {e.name[:90]}")


def profile(llm: LLM, batch: int, context: int, steps: int, trace: int = 0) -> None:
    engine = llm._executor.model_engine
    reqs = _requests(llm, batch, context)
    step = ScheduledRequests([], reqs)
    for _ in range(5):
        engine.forward(step)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.forward(step)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    runner = engine.cuda_graph_runner
    gpu = float("nan")
    if runner is not None:
        bucket = runner.bucket(batch)
        gpu = replay_time_us(runner.graphs[bucket], steps) / 1e3
    print(f"batch {batch}: engine.forward {wall:.2f} ms/step, graph replay (GPU) {gpu:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.forward(step)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    if trace:
        _kernel_trace(prof, trace)
    _release(llm, reqs)


def profile_mixed(llm: LLM, batch: int, context: int, chunks: list[int], steps: int) -> None:
    """Eager mixed steps: `batch` decodes plus one prefill chunk; wall vs GPU-busy time."""
    from tensorrt_llm.bench.gpu_idle import device_intervals_us, summarize_idle

    executor = llm._executor
    engine = executor.model_engine
    decodes = _requests(llm, batch, context)
    for n, chunk in enumerate(chunks):
        ids = [(11 * j + n) % 300 for j in range(chunk)]
        _, extra = llm.input_processor({"prompt_token_ids": ids}, None)
        req = LlmRequest(30_000 + n, ids)
        req.seq_slot = executor.seq_slot_manager.acquire(req.request_id)
        assert executor.kv_cache_manager.add_tokens(req.request_id, chunk + 8)
        req.context_chunk_size = chunk
        step = ScheduledRequests([req], decodes)

        def forward(req=req, step=step, data=extra["multimodal_data"]) -> None:
            # The engine drops a finished context's mRoPE positions; the same chunk is
            # replayed, so every step gets a fresh copy of the processor's output.
            req.multimodal_params = MultimodalParams(copy.deepcopy(data))
            engine.forward(step)

        for _ in range(3):  # compiles and allocations out of the timing
            forward()
        torch.cuda.synchronize()
        # Wall time without the profiler (its per-launch tracing slows the host), busy time
        # from a second, profiled pass.
        t0 = time.perf_counter()
        for _ in range(steps):
            forward()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                forward()
            torch.cuda.synchronize()
        busy = summarize_idle(device_intervals_us(prof)).busy_us / steps / 1e3
        print(
            f"mixed step: {batch} decodes + {chunk}-token chunk: wall {wall:.2f} ms, "
            f"GPU busy {busy:.2f} ms, idle {100 * (1 - busy / wall):.1f}%",
            flush=True,
        )
        _release(llm, [req])
    _release(llm, decodes)


def profile_prefill(llm: LLM, batch: int, context: int, image_size: int) -> None:
    """One context step of `batch` image+text requests: wall time and top kernels."""
    from tensorrt_llm._torch.config_utils import load_pretrained_config
    from tensorrt_llm.bench.workload import Workload, make_requests

    executor = llm._executor
    engine = executor.model_engine
    config = load_pretrained_config(llm.args.model)
    prompts = make_requests(config, Workload(context, 1, 1, image_size, batch))
    reqs = []
    for i, prompt in enumerate(prompts):
        ids, extra = llm.input_processor(prompt, None)
        req = LlmRequest(
            20_000 + i, ids, multimodal_params=MultimodalParams(extra["multimodal_data"])
        )
        req.seq_slot = executor.seq_slot_manager.acquire(req.request_id)
        assert executor.kv_cache_manager.add_tokens(req.request_id, len(ids) + 8)
        req.context_chunk_size = len(ids)
        reqs.append(req)
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        t0 = time.perf_counter()
        engine.forward(ScheduledRequests(reqs, []))
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    print(f"prefill batch {batch} x {context} tokens (+1 image each): {wall:.1f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    _release(llm, reqs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no_cuda_graph", action="store_true")
    p.add_argument(
        "--piecewise_max_tokens",
        type=int,
        default=None,
        help="piecewise prefill/mixed graphs (0: off; default: the engine's)",
    )
    p.add_argument("--prefill_batch", type=int, default=0, help="also profile a prefill step")
    p.add_argument("--mixed_chunks", type=int, nargs="*", default=[], help="prefill chunk sizes")
    p.add_argument("--quantization", choices=["fp8", "fp8_block"], default=None)
    p.add_argument(
        "--kernel_trace", type=int, default=0, help="print a decode step's first N kernels"
    )
    p.add_argument("--kv_cache_dtype", choices=["auto", "fp8"], default="auto")
    args = p.parse_args()
    folder = prepare_model_folder(args.config, tempfile.mkdtemp(), 512)
    llm = LLM(
        model=str(folder),
        load_format="dummy",
        dtype="bfloat16",
        # A mixed step holds `batch` decodes plus the prefill chunk's request.
        max_batch_size=max(args.batch + [args.prefill_batch]) + bool(args.mixed_chunks),
        max_num_tokens=8192,
        max_seq_len=args.context + 128,
        kv_cache_free_gpu_memory_fraction=0.5,
        cuda_graph_config=None
        if args.no_cuda_graph
        else {"piecewise_max_tokens": args.piecewise_max_tokens},
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        executor_mode="inproc",  # the profiler reads the engine in this process
    )
    try:
        if args.prefill_batch:
            profile_prefill(llm, args.prefill_batch, args.context, 512)
            profile_prefill(llm, args.prefill_batch, args.context, 512)  # warm
        for batch in args.batch:
            profile(llm, batch, args.context, args.steps, args.kernel_trace)
            if args.mixed_chunks:
                profile_mixed(llm, batch, args.context, args.mixed_chunks, args.steps)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
