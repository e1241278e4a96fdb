"""trtllm-bench: throughput and latency of image+text serving, with the HF baseline in the same run.

    trtllm-bench --config benchmarks/configs/qwen3_vl_8b.json --isl 1000 --osl 1000 \
        --image_size 512 --concurrency 1 32 64 128 --hf_baseline

Random weights at the config's real size (`load_format="dummy"`). Prints one row per concurrency
(output tok/s, per-user tok/s, TTFT/ITL/latency p50/p90/p99) and, with --hf_baseline, HF
transformers' figures on the same GPU and the ratio. --output writes everything as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..bench.runner import run_concurrency, warm_up
from ..bench.workload import Workload, make_requests, prepare_model_folder

_COLUMNS = (
    "concurrency",
    "output_tok_s",
    "per_user_tok_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "latency_ms_p50",
    "latency_ms_p99",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trtllm-bench", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="real-size config.json (benchmarks/configs)")
    p.add_argument("--isl", type=int, default=1000, help="prompt tokens, vision included")
    p.add_argument("--osl", type=int, default=1000)
    p.add_argument("--images_per_request", type=int, default=1)
    p.add_argument("--image_size", type=int, default=512)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument(
        "--num_requests",
        type=int,
        default=None,
        help="per concurrency (default: one wave, i.e. the concurrency itself, at least 2)",
    )
    p.add_argument("--ignore_eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--max_batch_size", type=int, default=None)
    p.add_argument("--max_num_tokens", type=int, default=8192)
    p.add_argument("--attn_backend", default="auto")
    p.add_argument("--no_cuda_graph", action="store_true")
    p.add_argument(
        "--piecewise_max_tokens",
        type=int,
        default=None,
        help="piecewise prefill/mixed graphs up to this many tokens (0: off; default: the "
        "engine's, up to 2048 on dense Qwen-VL models)",
    )
    p.add_argument("--hf_baseline", action="store_true", help="also run HF transformers")
    p.add_argument("--hf_max_osl", type=int, default=32, help="HF decode steps to time")
    p.add_argument(
        "--hf_concurrency",
        type=int,
        nargs="*",
        default=None,
        help="concurrencies for HF (default: the same list)",
    )
    p.add_argument("--kv_cache_fraction", type=float, default=0.8)
    p.add_argument(
        "--quantization",
        choices=["fp8"],
        default=None,
        help="fp8 weights+activations in the text decoder (ours only)",
    )
    p.add_argument(
        "--kv_cache_dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8: e4m3 KV cache (ours only)",
    )
    p.add_argument("--output", default=None, help="write results as JSON here")
    return p.parse_args(argv)


def _table(rows: list[dict[str, float]], columns: tuple[str, ...]) -> str:
    lines = [" | ".join(columns)]
    for row in rows:
        lines.append(" | ".join(f"{row.get(c, float('nan')):.1f}" for c in columns))
    return "\n".join(lines)


def _graph_config(args: argparse.Namespace) -> dict[str, int | None] | None:
    if args.no_cuda_graph:
        if args.piecewise_max_tokens:
            raise SystemExit("--piecewise_max_tokens needs CUDA graphs (drop --no_cuda_graph)")
        return None
    return {"piecewise_max_tokens": args.piecewise_max_tokens}


def _run_ours(args: argparse.Namespace, folder: Path, config: Any) -> list[dict[str, float]]:
    from ..llmapi.llm import LLM

    max_batch = args.max_batch_size or max(args.concurrency)
    llm = LLM(
        model=str(folder),
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_batch_size=max_batch,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.isl + args.osl + 8,
        attn_backend=args.attn_backend,
        cuda_graph_config=_graph_config(args),
        kv_cache_free_gpu_memory_fraction=args.kv_cache_fraction,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    rows = []
    try:
        for c in args.concurrency:
            n = args.num_requests or max(c, 2)
            workload = Workload(
                args.isl, args.osl, args.images_per_request, args.image_size, n, args.ignore_eos
            )
            prompts = make_requests(config, workload)
            warm_up(llm, prompts, workload)
            rows.append(run_concurrency(llm, prompts, workload, c))
            print(_table(rows[-1:], _COLUMNS), flush=True)
    finally:
        llm.shutdown()
    return rows


def _run_hf(args: argparse.Namespace, folder: Path, config: Any) -> list[dict[str, float]]:
    from ..bench.hf_baseline import build_hf_model, run_hf_baseline

    dtype = getattr(torch, args.dtype)
    model = build_hf_model(config, dtype, "cuda")
    rows = []
    for c in args.hf_concurrency or args.concurrency:
        workload = Workload(args.isl, args.hf_max_osl, args.images_per_request, args.image_size, c)
        prompts = make_requests(config, workload)
        rows.append(run_hf_baseline(model, str(folder), prompts, c, args.hf_max_osl))
        print("HF", rows[-1], flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .._torch.pyexecutor.config_utils import load_pretrained_config

    folder = prepare_model_folder(
        args.config, tempfile.mkdtemp(prefix="trtllm-bench-"), args.image_size
    )
    config = load_pretrained_config(folder)
    # HF first: its model is freed before ours sizes the KV cache from free memory.
    hf = _run_hf(args, folder, config) if args.hf_baseline else []
    ours = _run_ours(args, folder, config)
    result: dict[str, Any] = {"args": vars(args), "ours": ours}
    print("\nours\n" + _table(ours, _COLUMNS))
    if args.hf_baseline:
        result["hf"] = hf
        ratios = []
        for row in hf:
            match = next((r for r in ours if r["concurrency"] == row["concurrency"]), None)
            if match:
                ratio = match["output_tok_s"] / row["output_tok_s"]
                ratios.append({"concurrency": row["concurrency"], "throughput_ratio": ratio})
                print(
                    f"c={row['concurrency']}: ours {match['output_tok_s']:.0f} tok/s, "
                    f"HF {row['output_tok_s']:.0f} tok/s, ratio {ratio:.1f}x"
                )
        result["ratios"] = ratios
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
