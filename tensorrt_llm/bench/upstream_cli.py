"""trtllm-bench in upstream TensorRT-LLM's shape: a model folder, then a subcommand.

    trtllm-bench --model DIR prepare-dataset --output data.jsonl token-norm-dist \
        --num-requests 64 --input-mean 256 --output-mean 128 --images-per-request 1
    trtllm-bench --model DIR throughput --dataset data.jsonl --concurrency 1 8 32 \
        [--load_format dummy] [--hf_baseline] [--plot out.png]

DIR is a local checkpoint folder (no hub downloads here): its weights are loaded, or random ones
with `--load_format dummy` (config, tokenizer and processor files still come from DIR).
`throughput` runs the dataset's requests through the in-process LLM API at each concurrency and
prints the same table as the `--config` form.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .dataset import IMAGE_FORMATS, load_dataset, to_request, to_sampling_params
from .dataset import write_synthetic_dataset as write_dataset
from .metrics import RESULT_COLUMNS, format_table

SUBCOMMANDS = ("throughput", "prepare-dataset")
# Defaults of the in-process engine knobs, as in the --config form.
_MAX_NUM_TOKENS = 8192
_KV_FRACTION = 0.8


def is_upstream_form(argv: list[str]) -> bool:
    """Whether argv names one of upstream's subcommands (the --config form has none)."""
    return any(token in SUBCOMMANDS for token in argv)


def parse_upstream_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trtllm-bench", description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True, help="local checkpoint folder")
    p.add_argument(
        "--model_path",
        default=None,
        help="checkpoint folder when --model is a name (upstream's spelling); wins over --model",
    )
    sub = p.add_subparsers(dest="command", required=True)
    _add_throughput(sub.add_parser("throughput", help="benchmark a dataset's requests"))
    prep = sub.add_parser("prepare-dataset", help="write a synthetic image+text dataset")
    prep.add_argument("--output", required=True, help="the JSON-lines file to write")
    prep.add_argument("--random-seed", type=int, default=0)
    gen = prep.add_subparsers(dest="generator", required=True)
    norm = gen.add_parser("token-norm-dist", help="normally distributed lengths, noise images")
    norm.add_argument("--num-requests", type=int, required=True)
    norm.add_argument("--input-mean", type=int, required=True, help="text tokens per request")
    norm.add_argument("--input-stdev", type=int, default=0)
    norm.add_argument("--output-mean", type=int, required=True)
    norm.add_argument("--output-stdev", type=int, default=0)
    norm.add_argument("--images-per-request", type=int, default=1, help="(ours) 0: text only")
    norm.add_argument("--image-size", type=int, default=512, help="(ours) square side, pixels")
    norm.add_argument(
        "--image-format",
        choices=IMAGE_FORMATS,
        default="path",
        help="(ours) PNG files beside the dataset, or inline data URLs",
    )
    return p.parse_args(argv)


def _add_throughput(t: argparse.ArgumentParser) -> None:
    t.add_argument("--dataset", required=True, help="JSON lines (prepare-dataset writes them)")
    t.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="requests in flight; several values run one wave each (default: all at once)",
    )
    t.add_argument("--num_requests", type=int, default=None, help="the dataset's first N")
    t.add_argument("--warmup", type=int, default=2, help="short untimed requests first")
    t.add_argument("--backend", choices=["pytorch"], default="pytorch")
    t.add_argument("--load_format", choices=["auto", "dummy"], default="auto")
    t.add_argument("--dtype", default="auto")
    t.add_argument("--device", default="auto")
    t.add_argument("--attn_backend", default="auto")
    t.add_argument("--max_batch_size", type=int, default=None, help="default: max concurrency")
    t.add_argument("--tp_size", type=int, default=1, help="tensor-parallel ranks on this node")
    t.add_argument("--max_num_tokens", type=int, default=_MAX_NUM_TOKENS)
    t.add_argument("--max_seq_len", type=int, default=None, help="default: the checkpoint's")
    t.add_argument("--kv_cache_free_gpu_mem_fraction", type=float, default=_KV_FRACTION)
    t.add_argument("--ignore_eos", action=argparse.BooleanOptionalAction, default=True)
    t.add_argument(
        "--executor_mode", choices=("inproc", "process"), default=None, help="default: the LLM's"
    )
    t.add_argument("--hf_baseline", action="store_true", help="also time HF transformers")
    t.add_argument("--hf_max_osl", type=int, default=32, help="HF decode steps to time")
    t.add_argument("--report_json", "--output", dest="output", default=None, help="results JSON")
    t.add_argument("--plot", default=None, help="throughput/TTFT/ITL vs concurrency (PNG)")


def run_upstream(argv: list[str]) -> int:
    from .._torch.config_utils import load_pretrained_config

    args = parse_upstream_args(argv)
    folder = Path(args.model_path or args.model)
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"--model {folder}: no config.json there; trtllm-bench takes a local checkpoint "
            "folder (nothing is downloaded), with --load_format dummy for random weights"
        )
    config = load_pretrained_config(folder)
    if args.command == "prepare-dataset":
        out = write_dataset(
            config,
            args.output,
            num_requests=args.num_requests,
            input_mean=args.input_mean,
            output_mean=args.output_mean,
            input_stdev=args.input_stdev,
            output_stdev=args.output_stdev,
            images_per_request=args.images_per_request,
            image_size=args.image_size,
            image_format=args.image_format,
            seed=args.random_seed,
        )
        print(f"wrote {args.num_requests} requests to {out}")
        return 0
    return _throughput(args, folder, config)


def _throughput(args: argparse.Namespace, folder: Path, config: Any) -> int:
    from .plot import plot_results, require_matplotlib

    if args.plot:
        require_matplotlib()  # fail now, not after the waves
    entries = load_dataset(args.dataset, args.num_requests)
    prompts = [to_request(e, config) for e in entries]
    params = [to_sampling_params(e, args.ignore_eos) for e in entries]
    concurrencies = args.concurrency or [len(entries)]
    if min(concurrencies) < 1:
        raise SystemExit(f"--concurrency must be >= 1, got {concurrencies}")
    hf = _run_hf(args, folder, config, prompts, concurrencies) if args.hf_baseline else []
    rows = _run_ours(args, folder, prompts, params, concurrencies)
    print("\nours (in process)\n" + format_table(rows, RESULT_COLUMNS))
    result: dict[str, Any] = {"args": vars(args), "ours": rows}
    if hf:
        result["hf"] = hf
        result["ratios"] = []
        for row in rows:
            match = next((h for h in hf if h["concurrency"] == row["concurrency"]), None)
            if match and match["output_tok_s"]:
                ratio = row["output_tok_s"] / match["output_tok_s"]
                c = row["concurrency"]
                result["ratios"].append({"concurrency": c, "throughput_ratio": ratio})
                print(f"c={c}: ours/HF throughput {ratio:.1f}x")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2), encoding="utf-8")
    if args.plot:
        print(f"plot: {plot_results(args.plot, {'ours': rows}, hf)}")
    return 0


def _run_ours(
    args: argparse.Namespace,
    folder: Path,
    prompts: list[dict[str, Any]],
    params: list[Any],
    concurrencies: list[int],
) -> list[dict[str, float]]:
    from ..llmapi.llm import LLM
    from .runner import run_requests, warm_up_requests

    llm = LLM(
        model=str(folder),
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_batch_size=args.max_batch_size or max(concurrencies),
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        attn_backend=args.attn_backend,
        kv_cache_free_gpu_memory_fraction=args.kv_cache_free_gpu_mem_fraction,
        tensor_parallel_size=args.tp_size,
        **({"executor_mode": args.executor_mode} if args.executor_mode else {}),
    )
    rows = []
    try:
        warm_up_requests(llm, prompts, min(args.warmup, len(prompts)))
        for c in concurrencies:
            rows.append(run_requests(llm, prompts, params, c))
            print(format_table(rows[-1:], RESULT_COLUMNS), flush=True)
    finally:
        llm.shutdown()
    return rows


def _run_hf(
    args: argparse.Namespace,
    folder: Path,
    config: Any,
    prompts: list[dict[str, Any]],
    concurrencies: list[int],
) -> list[dict[str, float]]:
    """HF generate on the dataset's first `c` prompts per concurrency. HF batches without
    padding here, so the prompts must be token ids of one length (prepare-dataset's default)."""
    import torch

    from .hf_baseline import build_hf_model, free_accelerator, hf_device, run_hf_baseline

    lengths = {len(p["prompt_token_ids"]) if "prompt_token_ids" in p else -1 for p in prompts}
    if -1 in lengths or len(lengths) != 1:
        raise SystemExit(
            "--hf_baseline needs token-id prompts of one length (prepare-dataset with "
            "--input-stdev 0): HF generate runs them as one unpadded batch"
        )
    device = hf_device(args.device)
    dtype = getattr(config, "dtype", None) if args.dtype == "auto" else args.dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    # Random weights at the checkpoint's size: the timing does not depend on their values.
    model = build_hf_model(config, dtype or torch.float32, device)
    rows = []
    for c in concurrencies:
        if c > len(prompts):
            raise SystemExit(f"--hf_baseline: concurrency {c} > the dataset's {len(prompts)}")
        rows.append(run_hf_baseline(model, str(folder), prompts, c, args.hf_max_osl, device))
        print("HF", rows[-1], flush=True)
    del model
    free_accelerator()
    return rows
