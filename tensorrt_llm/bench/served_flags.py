"""trtllm-bench's served mode: its flags, and the trtllm-serve flags of a child server that
match the benchmark's engine knobs (unset knobs keep the server's defaults)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from .workload_modes import max_seq_len


def add_served_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("served mode")
    g.add_argument(
        "--served",
        action="store_true",
        help="benchmark a trtllm-serve child over HTTP (streaming chat, images as data URLs)",
    )
    g.add_argument(
        "--served_url",
        default=None,
        help="http://host:port of a running trtllm-serve to benchmark instead of a child "
        "(prompts are sized with --config's tokenizer)",
    )
    g.add_argument(
        "--inprocess_too",
        action="store_true",
        help="with --served: run the in-process figures first and report served/in-process",
    )
    g.add_argument(
        "--serve_args",
        default="",
        help="more trtllm-serve flags for the child, as one shell-quoted string "
        '(e.g. "--num_preprocess_workers 8")',
    )
    g.add_argument(
        "--server_startup_timeout",
        type=float,
        default=1800.0,
        help="seconds the trtllm-serve child gets to answer /health",
    )


def serve_flags(args: argparse.Namespace, folder: Path) -> list[str]:
    """trtllm-serve's flags for the benchmark's knobs; unset knobs keep the server's defaults."""
    if args.no_cuda_graph or args.piecewise_max_tokens is not None:
        raise SystemExit(
            "--served: trtllm-serve has no CUDA-graph flags yet; drop --no_cuda_graph and "
            "--piecewise_max_tokens so both modes run the engine's default graphs"
        )
    flags = [str(folder), "--load_format", "dummy", "--dtype", args.dtype, "--device", args.device]
    flags += ["--max_seq_len", str(max_seq_len(args)), "--attn_backend", args.attn_backend]
    flags += ["--kv_cache_dtype", args.kv_cache_dtype]
    flags += ["--mamba_ssm_cache_dtype", args.mamba_ssm_cache_dtype]
    flags += ["--stream_interval", str(args.stream_interval)]
    if args.executor_mode:
        flags += ["--executor_mode", args.executor_mode]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    if args.enable_block_reuse is not None:
        flags.append(
            "--enable_block_reuse" if args.enable_block_reuse else "--no-enable_block_reuse"
        )
    if args.capacity_scheduler_policy:
        raise SystemExit(
            "--capacity_scheduler_policy is in process only; a server takes it as scheduler_config "
            "in an --extra_llm_api_options YAML (pass it through --serve_args)"
        )
    for name, flag in (
        ("tp_size", "--tp_size"),
        ("max_batch_size", "--max_batch_size"),
        ("max_num_tokens", "--max_num_tokens"),
        ("kv_cache_fraction", "--kv_cache_free_gpu_memory_fraction"),
    ):
        if getattr(args, name) is not None:
            flags += [flag, str(getattr(args, name))]
    if args.images_per_request:
        flags += ["--limit_mm_per_prompt", f"image={args.images_per_request}"]
    # A benchmark that fails mid-wave leaves streams open; the stop should not wait 30 s on them.
    return flags + ["--timeout_graceful_shutdown", "2", *shlex.split(args.serve_args)]
