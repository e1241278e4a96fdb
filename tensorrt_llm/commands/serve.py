"""`trtllm-serve`: serve a local Qwen(-VL) checkpoint over an OpenAI-compatible HTTP API.

trtllm-serve serve /path/to/checkpoint --port 8000 --limit_mm_per_prompt '{"image": 2}'
trtllm-serve serve --demo    # the tiny random demo checkpoint, built locally on first use
trtllm-serve serve /path/to/checkpoint --extra_llm_api_options config.yaml

`serve` is TensorRT-LLM's subcommand; the older form without it (`trtllm-serve MODEL`) works
the same. A folder named `serve` is still served by `trtllm-serve serve` alone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path
from typing import Any

from ..llmapi.upstream_args import BACKENDS
from ..serve.log_config import configure_logging
from ..serve.server_args import load_llm_api_options
from .serve_flags import (  # noqa: F401 (re-exported: parse_mm_limits)
    UPSTREAM_LOG_LEVELS,
    build_parser,
    parse_mm_limits,
)

# Backends TensorRT-LLM's trtllm-serve offers; only "pytorch" exists in this build.
UPSTREAM_BACKENDS = ("pytorch", "tensorrt", "_autodeploy")
# LLM(...) keyword arguments that map 1:1 to flags (flag left unset -> the LLM's default).
_LLM_FLAGS: tuple[str, ...] = (
    "max_batch_size",
    "max_num_tokens",
    "enable_chunked_prefill",
    "enable_block_reuse",
    "max_seq_len",
    "kv_cache_free_gpu_memory_fraction",
    "limit_mm_per_prompt",
    "device",
    "dtype",
    "attn_backend",
    "quantization",
    "kv_cache_dtype",
    "mamba_ssm_cache_dtype",
    "stream_interval",
    "load_format",
    "executor_mode",
    "generation_config",
    "backend",
)
# Flags spelled as TensorRT-LLM's trtllm-serve spells them -> the LLM argument they set.
_LLM_FLAGS = (*_LLM_FLAGS, "speculative_config", "disable_overlap_scheduler")
_RENAMED_LLM_FLAGS = {"tp_size": "tensor_parallel_size", "pp_size": "pipeline_parallel_size"}


def _strip_subcommand(argv: list[str]) -> list[str]:
    """Drop TensorRT-LLM's `serve` subcommand. NOTE: `trtllm-serve serve` with nothing else
    names the model folder `serve` (the old form), so an existing command keeps its meaning."""
    if argv[:1] != ["serve"]:
        return argv
    rest = argv[1:]
    try:
        # Quiet: --help or a flag error is printed once, by the real parse.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            probe, _ = build_parser().parse_known_args(rest)
    except SystemExit:
        return rest
    return rest if probe.model_dir is not None or probe.demo else argv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    argv = _strip_subcommand(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if args.demo == (args.model_dir is not None):
        parser.error("give either a model_dir or --demo (exactly one)")
    args.log_level = UPSTREAM_LOG_LEVELS.get(args.log_level, args.log_level)
    if args.backend is not None and args.backend not in BACKENDS:
        what = (
            "a TensorRT-LLM backend this build does not have"
            if args.backend in UPSTREAM_BACKENDS
            else "no such backend"
        )
        parser.error(f"--backend {args.backend}: {what}; choose from {list(BACKENDS)}")
    if args.pp_size is not None and args.pp_size > 1:
        parser.error(f"--pp_size {args.pp_size}: pipeline parallelism is not supported yet")
    try:
        args.llm_api_options = load_llm_api_options(args.extra_llm_api_options, _flag_kwargs(args))
    except ValueError as exc:
        parser.error(str(exc))
    if args.allowed_local_media_path and not Path(args.allowed_local_media_path).is_dir():
        parser.error(f"--allowed_local_media_path {args.allowed_local_media_path} is not a folder")
    if args.default_max_tokens < 1:
        parser.error("--default_max_tokens must be >= 1")
    for name in (
        "max_request_body_bytes",
        "max_prompts_per_request",
        "max_sequences_per_request",
        "max_media_bytes",
        "max_media_pixels",
        "max_video_pixels",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    for name in ("body_read_timeout", "header_read_timeout", "media_fetch_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be positive")
    if args.num_preprocess_workers is not None and args.num_preprocess_workers < 0:
        parser.error("--num_preprocess_workers must be >= 0")
    if args.timeout_graceful_shutdown < 0:
        parser.error("--timeout_graceful_shutdown must be >= 0")
    return args


def resolve_model_dir(args: argparse.Namespace) -> str:
    if args.demo:
        from ..tools.tiny_checkpoint import get_or_build_demo_checkpoint

        return str(get_or_build_demo_checkpoint())
    return str(args.model_dir)


def _flag_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM arguments the command line gives (a flag left unset: not there)."""
    names = {name: name for name in _LLM_FLAGS} | _RENAMED_LLM_FLAGS
    kwargs = {arg: getattr(args, flag, None) for flag, arg in names.items()}
    return {arg: value for arg, value in kwargs.items() if value is not None}


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments: the flags given plus the --extra_llm_api_options file (a key
    in both was refused by parse_args)."""
    return {**getattr(args, "llm_api_options", {}), **_flag_kwargs(args)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    from ..llmapi.llm import LLM
    from ..serve.app import build_app
    from ..serve.lifecycle import make_server

    model_dir = resolve_model_dir(args)
    try:
        llm = LLM(model=model_dir, **llm_kwargs(args))
    except ValueError as exc:
        sys.exit(f"trtllm-serve: {exc}")
    app = build_app(llm, args)
    server = make_server(
        app,
        app.state.server.drain,
        header_read_timeout_s=args.header_read_timeout,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # uvicorn's loggers propagate to configure_logging's handler
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        engine_alive=app.state.server.client.engine_alive,
    )
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn re-raises Ctrl-C after its (already finished) graceful shutdown.
        pass
    if server.engine_died:
        sys.exit("trtllm-serve: the engine died; every pending request was failed")


if __name__ == "__main__":
    main()
