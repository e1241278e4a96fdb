"""`trtllm-serve`'s flags: the argparse parser (`build_parser`), spelled as TensorRT-LLM's
trtllm-serve spells them where it has them, with their defaults and help, and the
`--limit_mm_per_prompt` value parser. serve.py parses the command line with it and checks the
values.
"""

from __future__ import annotations

import argparse
import json

from ..inputs.image_formats import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_VIDEO_PIXELS
from ..serve.lifecycle import DEFAULT_HEADER_READ_TIMEOUT_S
from ..serve.request_body import DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_REQUEST_BODY_BYTES
from ..serve.server_args import (
    DEFAULT_MAX_PROMPTS,
    DEFAULT_MAX_SEQUENCES,
    parse_speculative_config_arg,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# TensorRT-LLM's severities -> the Python logging level they mean.
UPSTREAM_LOG_LEVELS = {"internal_error": "critical", "verbose": "debug", "trace": "debug"}


def parse_mm_limits(text: str) -> dict[str, int]:
    """'{"image": 2}' (JSON) or 'image=2,video=1' -> {"image": 2, "video": 1}."""
    text = text.strip()
    try:
        if text.startswith("{"):
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise ValueError("expected a JSON object")
        else:
            raw = {}
            for item in filter(None, (p.strip() for p in text.split(","))):
                key, sep, value = item.partition("=")
                if not sep:
                    raise ValueError(f"expected modality=count, got {item!r}")
                raw[key.strip()] = value.strip()
        limits = {str(k): int(v) for k, v in raw.items()}
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"--limit_mm_per_prompt takes JSON like '{{\"image\": 2}}' or image=2,video=1: {exc}"
        ) from None
    bad = [k for k, v in limits.items() if k not in ("image", "video") or v < 0]
    if bad:
        raise argparse.ArgumentTypeError(
            f"--limit_mm_per_prompt: unknown modality or negative count for {bad}; "
            "modalities are image and video"
        )
    return limits


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trtllm-serve", description="OpenAI-compatible server for Qwen(-VL) checkpoints."
    )
    p.add_argument("model_dir", nargs="?", help="local HF checkpoint folder (omit with --demo)")
    p.add_argument("--demo", action="store_true", help="serve the tiny random demo checkpoint")
    p.add_argument("--host", default="localhost", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served_model_name", default=None, help="model id (default: folder name)")
    p.add_argument(
        "--max_batch_size",
        type=int,
        default=None,
        help="most sequences in flight (default: sized at startup; 8 on the CPU)",
    )
    p.add_argument(
        "--max_num_tokens", type=int, default=None, help="token budget of one step (decodes first)"
    )
    p.add_argument(
        "--enable_chunked_prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prompts over steps (default: on; --no-enable_chunked_prefill: off)",
    )
    p.add_argument(
        "--enable_block_reuse",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching: reuse the KV of cached prompt prefixes (default: on, off for "
        "hybrid models, where it also keeps recurrent-state snapshots; --no-enable_block_reuse: "
        "off); also kv_cache_config.enable_block_reuse",
    )
    p.add_argument(
        "--max_seq_len",
        type=int,
        default=None,
        help="prompt + output tokens of one sequence (default: the checkpoint's "
        "max_position_embeddings, capped by the KV cache on CUDA and at 8192 on the CPU)",
    )
    p.add_argument(
        "--kv_cache_free_gpu_memory_fraction",
        type=float,
        default=None,
        help="share of the GPU memory left after the weights that the KV cache takes "
        "(default: 0.9); CUDA only: the CPU cache holds max_batch_size x max_seq_len tokens",
    )
    p.add_argument(
        "--limit_mm_per_prompt",
        type=parse_mm_limits,
        default=None,
        help="max media items per prompt: '{\"image\": 2}' or image=2,video=1 "
        "(default: 16 images, 2 videos)",
    )
    p.add_argument(
        "--allowed_local_media_path",
        default=None,
        help="folder whose files requests may reference (file:// URLs); off by default",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=None,
        help="auto (default): CUDA when present, else the CPU",
    )
    # Validated by LLM(...), whose error message lists the accepted values.
    p.add_argument(
        "--dtype",
        default=None,
        help="auto | float32 | bfloat16 | float16 (auto: the checkpoint's on CUDA, float32 on "
        "the CPU)",
    )
    p.add_argument(
        "--attn_backend",
        default=None,
        help="auto | vanilla | triton | flash_attn (auto: triton on CUDA, vanilla on the CPU; "
        "triton and flash_attn need CUDA)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="fp8 (per-channel FP8 weights, per-token activations) | fp8_block (128x128 "
        "block-scaled FP8 weights); default: the checkpoint as it is",
    )
    p.add_argument("--kv_cache_dtype", default=None, help="auto | fp8 (e4m3 KV cache)")
    p.add_argument(
        "--mamba_ssm_cache_dtype",
        default=None,
        help="hybrid models' Gated DeltaNet state: auto (the checkpoint's mamba_ssm_dtype, else "
        "float32) | float32 | bfloat16 | float16",
    )
    p.add_argument(
        "--stream_interval",
        type=int,
        default=None,
        help="after its first token a stream gets its new tokens every N tokens (default 1: "
        "each token); larger values cut the server's per-token work at high concurrency",
    )
    p.add_argument(
        "--load_format",
        choices=("auto", "dummy"),
        default=None,
        help="dummy: random weights, no safetensors needed (benchmarks of a config's real size)",
    )
    p.add_argument(
        "--executor_mode",
        choices=("inproc", "process"),
        default=None,
        help="process: the engine runs in its own process (ZeroMQ); inproc: a thread of this one",
    )
    p.add_argument(
        "--generation_config",
        choices=("auto", "ignore"),
        default=None,
        help="auto (default): the checkpoint's generation_config.json gives the sampling "
        "defaults (temperature, top_p, top_k, do_sample, eos ids) of fields a request omits; "
        "ignore: the built-in defaults",
    )
    p.add_argument(
        "--log_level",
        choices=(*LOG_LEVELS, *UPSTREAM_LOG_LEVELS),
        default="info",
        help="our loggers' and uvicorn's level (TensorRT-LLM's internal_error/verbose/trace "
        "mean critical/debug/debug)",
    )
    p.add_argument("--default_max_tokens", type=int, default=256, help="when a request has none")
    p.add_argument(
        "--timeout_graceful_shutdown",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on shutdown before they are failed",
    )
    _add_upstream_flags(p)
    _add_chat_flags(p)
    _add_media_flags(p)
    _add_request_bounds(p)
    return p


def _add_chat_flags(p: argparse.ArgumentParser) -> None:
    from ..serve.reasoning_parser import REASONING_PARSERS
    from ..serve.tool_parsers import TOOL_PARSERS

    g = p.add_argument_group("chat outputs")
    g.add_argument(
        "--reasoning_parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think>...</think> into message.reasoning_content (default: off)",
    )
    g.add_argument(
        "--tool_call_parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are read from the output of requests with tools (default: from "
        "the checkpoint: qwen3_coder for Qwen3.5/3.6, hermes for the others)",
    )


def _add_upstream_flags(p: argparse.ArgumentParser) -> None:
    """TensorRT-LLM's trtllm-serve flags, checked by LlmArgs like the Python API's names."""
    g = p.add_argument_group("TensorRT-LLM flags")
    g.add_argument("--backend", default=None, help="pytorch (the only backend of this build)")
    g.add_argument(
        "--tp_size",
        type=int,
        default=None,
        help="tensor-parallel ranks on this node (LLM's tensor_parallel_size)",
    )
    g.add_argument(
        "--pp_size",
        type=int,
        default=None,
        help="pipeline-parallel GPUs (LLM's pipeline_parallel_size); only 1 is supported yet",
    )
    g.add_argument(
        "--speculative_config",
        type=parse_speculative_config_arg,
        default=None,
        metavar="JSON|FILE",
        help='speculative decoding, e.g. \'{"decoding_type": "MTP", "num_nextn_predict_layers": '
        "3}' or a YAML/JSON file of it (needs --disable_overlap_scheduler)",
    )
    g.add_argument(
        "--disable_overlap_scheduler",
        action="store_true",
        default=None,
        help="run the executor without the overlap scheduler (MTP speculation needs it)",
    )
    g.add_argument(
        "--extra_llm_api_options",
        default=None,
        metavar="YAML",
        help="a YAML file of LLM(...) arguments, e.g. 'kv_cache_config: "
        "{free_gpu_memory_fraction: 0.8}'; a key also given as a flag is an error",
    )


def _add_media_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("media sources")
    g.add_argument(
        "--allow_remote_media",
        action="store_true",
        help="fetch http(s) media URLs from any public host (off by default)",
    )
    g.add_argument(
        "--allowed_media_domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="fetch http(s) media only from these hosts ('*.example.com' for subdomains); "
        "turns remote fetching on for them",
    )
    g.add_argument(
        "--allow_private_media_addresses",
        action="store_true",
        help="let media URLs reach loopback, private and link-local addresses (trusted "
        "networks only)",
    )
    g.add_argument(
        "--media_fetch_timeout",
        type=float,
        default=10.0,
        help="seconds for a whole fetch: lookup, redirects and body",
    )
    g.add_argument(
        "--max_media_bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="bytes one image or video may have (a data URL, a local file or a fetch)",
    )
    g.add_argument(
        "--max_media_pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help="pixels an image may declare (checked before decoding)",
    )
    g.add_argument(
        "--max_video_pixels",
        type=int,
        default=DEFAULT_MAX_VIDEO_PIXELS,
        help="pixels of all frames of a video together",
    )


def _add_request_bounds(p: argparse.ArgumentParser) -> None:
    """Flags bounding the work one request (or one connection) can make the server do."""
    g = p.add_argument_group("per-request bounds")
    g.add_argument(
        "--max_request_body_bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger bodies get 413 (checked before they are read)",
    )
    g.add_argument(
        "--body_read_timeout",
        type=float,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="seconds to receive a whole request body (408 after)",
    )
    g.add_argument(
        "--header_read_timeout",
        type=float,
        default=DEFAULT_HEADER_READ_TIMEOUT_S,
        help="seconds to receive a request's headers before the connection is closed",
    )
    g.add_argument(
        "--num_preprocess_workers",
        type=int,
        default=None,
        help="worker processes for media decoding, tokenization and the image/video "
        "processor (default: half the cores, at most 8, on CUDA; 0 on CPU; 0 = the server's "
        "own threads)",
    )
    g.add_argument(
        "--max_prompts_per_request",
        type=int,
        default=DEFAULT_MAX_PROMPTS,
        help="prompts in one /v1/completions request",
    )
    g.add_argument(
        "--max_sequences_per_request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES,
        help="prompts x n of one request",
    )
