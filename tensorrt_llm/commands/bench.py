"""trtllm-bench: throughput and latency of image+text serving, with the HF baseline in the same run.

    trtllm-bench --config benchmarks/configs/qwen3_vl_8b.json --isl 1000 --osl 1000 \
        --image_size 512 --concurrency 1 32 64 128 --hf_baseline

Random weights at the config's real size (`load_format="dummy"`). Prints one row per concurrency
(output tok/s, per-user tok/s, TTFT/ITL/latency p50/p90/p99) and, with --hf_baseline, HF
transformers' figures on the same GPU and the ratio. --output writes everything as JSON.

    trtllm-bench --config benchmarks/configs/qwen3_vl_8b.json --served --inprocess_too ...

--served measures the served path instead: a `trtllm-serve` child on the same random-weight
folder (or the server at --served_url), driven with streaming OpenAI chat requests (images as
PNG data URLs). --inprocess_too runs the in-process figures first and prints the served /
in-process ratio per concurrency. --plot out.png draws throughput, TTFT and ITL against
concurrency (the `plot` extra: matplotlib). --multi_turn N (conversations, per-turn TTFT and
prefix-cache hit rate) and --max_tokens_dist LO HI (early stops) shape the workload otherwise.

    trtllm-bench --model DIR prepare-dataset --output data.jsonl token-norm-dist ...
    trtllm-bench --model DIR throughput --dataset data.jsonl --concurrency 1 8 [--plot out.png]

Upstream TensorRT-LLM's shape (bench/upstream_cli.py): a real checkpoint folder (or random
weights with --load_format dummy) and a JSON-lines dataset of image+text requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..bench.hf_baseline import free_accelerator as _free_accelerator
from ..bench.hf_baseline import hf_device as _hf_device
from ..bench.metrics import RESULT_COLUMNS as _COLUMNS
from ..bench.metrics import format_table as _table
from ..bench.multi_turn import TURN_COLUMNS
from ..bench.plot import plot_results, require_matplotlib
from ..bench.served import STAGE_COLUMNS, served_target, single_token_words, text_tokens_for_isl
from ..bench.served_flags import add_served_flags, serve_flags
from ..bench.spec_modes import add_spec_flags, check_spec_flags, run_spec_wave, spec_llm_kwargs
from ..bench.upstream_cli import is_upstream_form, run_upstream
from ..bench.workload import Workload, make_requests, prepare_model_folder
from ..bench.workload_modes import (
    add_workload_flags,
    check_workload_flags,
    max_seq_len,
    table_columns,
    wave_ours,
    wave_served,
)

_SERVED_COLUMNS = (
    *_COLUMNS,
    "isl_mean",
    *STAGE_COLUMNS,
    "server_cpu_pct",
    "server_seq_slots",
)
# In-process defaults of knobs that the served mode leaves to trtllm-serve unless given.
_INPROCESS_MAX_NUM_TOKENS = 8192
_INPROCESS_KV_FRACTION = 0.8


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
    p.add_argument(
        "--guided_json",
        default=None,
        help="a JSON-schema file every request's output must follow (structured output; "
        "needs --no-ignore_eos: a finished structure ends the request)",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--max_batch_size", type=int, default=None)
    p.add_argument(
        "--tp_size",
        type=int,
        default=1,
        help="tensor-parallel ranks on this node (LLM's tensor_parallel_size; needs "
        "--no_cuda_graph for now)",
    )
    p.add_argument(
        "--max_num_tokens",
        type=int,
        default=None,
        help=f"default: {_INPROCESS_MAX_NUM_TOKENS} in process, the server's own with --served",
    )
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
    p.add_argument(
        "--kv_cache_fraction",
        type=float,
        default=None,
        help=f"default: {_INPROCESS_KV_FRACTION} in process, the server's own with --served",
    )
    p.add_argument(
        "--quantization",
        choices=["fp8", "fp8_block"],
        default=None,
        help="fp8: per-channel FP8 weights+activations in the text decoder; fp8_block: the "
        "-FP8 releases' 128x128 block layout (ours only)",
    )
    p.add_argument(
        "--kv_cache_dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8: e4m3 KV cache (ours only)",
    )
    p.add_argument(
        "--mamba_ssm_cache_dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="hybrid models' DeltaNet state (auto: the checkpoint's mamba_ssm_dtype, else float32)",
    )
    p.add_argument(
        "--stream_interval",
        type=int,
        default=1,
        help="the engine's responses carry a stream's tokens N at a time after the first "
        "(ours only; in process and --served)",
    )
    p.add_argument(
        "--enable_block_reuse",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching (default: the engine's, on for full-attention models)",
    )
    p.add_argument(
        "--capacity_scheduler_policy",
        choices=["MAX_UTILIZATION", "GUARANTEED_NO_EVICT"],
        default=None,
        help="admission (default MAX_UTILIZATION: KV on demand with preemption; "
        "GUARANTEED_NO_EVICT: prompt + max_tokens reserved up front); in process only",
    )
    p.add_argument(
        "--executor_mode",
        choices=("inproc", "process"),
        default=None,
        help="where the engine runs (both modes; default: the LLM's / the server's default)",
    )
    p.add_argument("--output", default=None, help="write results as JSON here")
    p.add_argument(
        "--plot", default=None, help="throughput/TTFT/ITL vs concurrency as a PNG (matplotlib)"
    )
    add_served_flags(p)
    add_workload_flags(p)
    add_spec_flags(p)
    args = p.parse_args(argv)
    check_workload_flags(p, args)
    check_spec_flags(p, args)
    if args.served_url:
        args.served = True
    if args.inprocess_too and not args.served:
        p.error("--inprocess_too goes with --served (or --served_url)")
    if args.serve_args and (args.served_url or not args.served):
        p.error("--serve_args goes with --served (a child server), not --served_url")
    return args


def _graph_config(args: argparse.Namespace) -> dict[str, int | None] | None:
    if args.no_cuda_graph:
        if args.piecewise_max_tokens:
            raise SystemExit("--piecewise_max_tokens needs CUDA graphs (drop --no_cuda_graph)")
        return None
    return {"piecewise_max_tokens": args.piecewise_max_tokens}


def _run_ours(
    args: argparse.Namespace, folder: Path, config: Any, turns: list[dict[str, float]]
) -> list[dict[str, float]]:
    """One row per concurrency; a --multi_turn run's per-turn rows go to `turns`."""
    from ..llmapi.llm import LLM

    max_batch = args.max_batch_size or max(args.concurrency)
    max_num_tokens = args.max_num_tokens or _INPROCESS_MAX_NUM_TOKENS
    kv_fraction = (
        _INPROCESS_KV_FRACTION if args.kv_cache_fraction is None else args.kv_cache_fraction
    )
    llm = LLM(
        model=str(folder),
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_batch_size=max_batch,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len(args),
        attn_backend=args.attn_backend,
        cuda_graph_config=_graph_config(args),
        kv_cache_free_gpu_memory_fraction=kv_fraction,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        stream_interval=args.stream_interval,
        tensor_parallel_size=args.tp_size,
        **(
            ({"executor_mode": args.executor_mode} if args.executor_mode else {})
            | spec_llm_kwargs(args)
            | _policy_kwargs(args)
        ),
    )
    rows = []
    try:
        for c in args.concurrency:
            row, turn_rows = run_spec_wave(
                llm, args, lambda c=c: wave_ours(llm, config, folder, args, c, guided_schema(args))
            )
            rows.append(row)
            turns.extend(turn_rows)
            print(_table(rows[-1:], table_columns(rows, _COLUMNS)), flush=True)
            if turn_rows:
                print(_table(turn_rows, TURN_COLUMNS), flush=True)
    finally:
        llm.shutdown()
    return rows


def _policy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM kwargs of --enable_block_reuse and --capacity_scheduler_policy (unset: none)."""
    kwargs: dict[str, Any] = {}
    if args.enable_block_reuse is not None:
        kwargs["kv_cache_config"] = {"enable_block_reuse": args.enable_block_reuse}
    if args.capacity_scheduler_policy:
        kwargs["scheduler_config"] = {"capacity_scheduler_policy": args.capacity_scheduler_policy}
    return kwargs


def guided_schema(args: argparse.Namespace) -> str | None:
    """The --guided_json file's schema as JSON text, checked (None without the flag)."""
    path = getattr(args, "guided_json", None)
    if not path:
        return None
    if args.ignore_eos:
        raise SystemExit("--guided_json needs --no-ignore_eos: the structure ends each request")
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--guided_json {path}: {exc}") from None
    if not isinstance(schema, dict):
        raise SystemExit(f"--guided_json {path}: a JSON schema object expected")
    return json.dumps(schema)


def _run_served(
    args: argparse.Namespace, folder: Path, config: Any, turns: list[dict[str, float]]
) -> list[dict[str, float]]:
    """As `_run_ours`, over HTTP."""
    words = single_token_words(folder / "tokenizer.json")
    flags = [] if args.served_url else serve_flags(args, folder)
    log = folder / "trtllm-serve.log"
    rows = []
    with served_target(args.served_url, flags, log, args.server_startup_timeout) as target:
        probe = Workload(
            args.isl, args.osl, args.images_per_request, args.image_size, 1, args.ignore_eos
        )
        num_text = text_tokens_for_isl(target, config, probe, words)
        for c in args.concurrency:
            guided = guided_schema(args)
            row, turn_rows = wave_served(target, config, args, words, num_text, c, guided)
            rows.append(row)
            turns.extend(turn_rows)
            print("served\n" + _table(rows[-1:], table_columns(rows, _SERVED_COLUMNS)), flush=True)
            if turn_rows:
                print(_table(turn_rows, TURN_COLUMNS), flush=True)
    return rows


def _ratios(num: list[dict[str, float]], den: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per concurrency present in both: throughput, TTFT p50 and ITL p50 of num over den
    (those both rows have: the HF baseline's rows carry throughput and means only)."""
    out = []
    for row in num:
        match = next((r for r in den if r["concurrency"] == row["concurrency"]), None)
        if match is None:
            continue
        ratio = {"concurrency": row["concurrency"]}
        for key in ("output_tok_s", "ttft_ms_p50", "itl_ms_p50"):
            if key in row and key in match:
                ratio[f"{key}_ratio"] = row[key] / match[key] if match[key] else float("nan")
        out.append(ratio)
    return out


def _run_hf(args: argparse.Namespace, folder: Path, config: Any) -> list[dict[str, float]]:
    from ..bench.hf_baseline import build_hf_model, run_hf_baseline

    dtype = getattr(torch, args.dtype)
    device = _hf_device(args.device)
    model = build_hf_model(config, dtype, device)
    rows = []
    for c in args.hf_concurrency or args.concurrency:
        workload = Workload(args.isl, args.hf_max_osl, args.images_per_request, args.image_size, c)
        prompts = make_requests(config, workload)
        rows.append(run_hf_baseline(model, str(folder), prompts, c, args.hf_max_osl, device))
        print("HF", rows[-1], flush=True)
    del model
    _free_accelerator()
    return rows


def _report(args: argparse.Namespace, result: dict[str, Any], hf: list[dict[str, float]]) -> None:
    """Print the tables and ratios, and add the ratios to `result`."""
    ours, served = result.get("ours"), result.get("served")
    if ours is not None:
        print("\nours (in process)\n" + _table(ours, table_columns(ours, _COLUMNS)))
        if result.get("ours_turns"):
            print("per turn\n" + _table(result["ours_turns"], TURN_COLUMNS))
    if served is not None:
        table = _table(served, table_columns(served, _SERVED_COLUMNS))
        print("\nserved (trtllm-serve over HTTP)\n" + table)
        if result.get("served_turns"):
            print("per turn\n" + _table(result["served_turns"], TURN_COLUMNS))
    if ours is not None and served is not None:
        result["served_vs_inprocess"] = _ratios(served, ours)
        for r in result["served_vs_inprocess"]:
            print(
                f"c={r['concurrency']}: served/in-process throughput "
                f"{r['output_tok_s_ratio']:.3f}, TTFT p50 {r['ttft_ms_p50_ratio']:.3f}, "
                f"ITL p50 {r['itl_ms_p50_ratio']:.3f}"
            )
    if args.hf_baseline:
        # The headline is the served figure when there is one.
        headline = served if served is not None else ours
        result["hf"] = hf
        result["ratios"] = [
            {"concurrency": r["concurrency"], "throughput_ratio": r["output_tok_s_ratio"]}
            for r in _ratios(headline or [], hf)
        ]
        for r in result["ratios"]:
            print(f"c={r['concurrency']}: ours/HF throughput {r['throughput_ratio']:.1f}x")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if is_upstream_form(argv):
        return run_upstream(argv)
    args = parse_args(argv)
    if args.plot:
        require_matplotlib()  # fail now, not after the waves
    # The model folder (config, tokenizer, processor files) lives only as long as the run.
    with tempfile.TemporaryDirectory(prefix="trtllm-bench-") as scratch:
        return _main(args, Path(scratch))


def _main(args: argparse.Namespace, scratch: Path) -> int:
    from .._torch.config_utils import load_pretrained_config

    folder = prepare_model_folder(args.config, scratch, args.image_size)
    config = load_pretrained_config(folder)
    # HF first: its model is freed before ours sizes the KV cache from free memory.
    hf = _run_hf(args, folder, config) if args.hf_baseline else []
    result: dict[str, Any] = {"args": vars(args)}
    # --multi_turn's per-turn rows, in process and served.
    turns: list[dict[str, float]] = []
    served_turns: list[dict[str, float]] = []
    if not args.served or args.inprocess_too:
        result["ours"] = _run_ours(args, folder, config, turns)
        if args.multi_turn:
            result["ours_turns"] = turns
        _free_accelerator()  # the served child sizes its KV cache from what is free now
    if args.served:
        result["served"] = _run_served(args, folder, config, served_turns)
        if args.multi_turn:
            result["served_turns"] = served_turns
    _report(args, result, hf)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2), encoding="utf-8")
    if args.plot:
        series = {"ours": result.get("ours", []), "served": result.get("served", [])}
        print(f"plot: {plot_results(args.plot, series, hf)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
