"""Field checks of `LlmArgs` that need more than a type or range test: the checkpoint paths,
the per-modality limits, flash-attn's host-side rules and the `cuda_graph_config` forms.

Kept apart from llm_args.py so it holds the fields, their order of checks in `__post_init__`
and the resolution into `EngineConfig`; each helper here takes the (frozen) args object and
raises a ValueError naming the field, as the inline checks there do.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._torch.attention_backend.interface import FLASH_ATTN_PAGE_MULTIPLE
from .._torch.pyexecutor.engine_config import CudaGraphConfig, check_int

if TYPE_CHECKING:
    from .llm_args import LlmArgs

logger = logging.getLogger(__name__)

MODALITIES = ("image", "video")


def check_choice(name: str, value: Any, choices: Sequence[str | None]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def validate_flash_attn(args: LlmArgs) -> None:
    # The host-checkable half of flash-attn's rules (the backend checks the rest).
    if args.tokens_per_block % FLASH_ATTN_PAGE_MULTIPLE:
        raise ValueError(
            f"attn_backend 'flash_attn' needs tokens_per_block to be a multiple of "
            f"{FLASH_ATTN_PAGE_MULTIPLE} (flash-attn's paged KV page size), got "
            f"{args.tokens_per_block}"
        )
    if args.kv_cache_dtype != "auto":
        raise ValueError(
            f"attn_backend 'flash_attn' has no {args.kv_cache_dtype} KV cache; use "
            "kv_cache_dtype='auto'"
        )
    if args.dtype == "float32" or args.device == "cpu":
        raise ValueError(
            "attn_backend 'flash_attn' runs fp16/bf16 models on CUDA, got "
            f"dtype={args.dtype!r}, device={args.device!r}"
        )


def validate_paths(args: LlmArgs) -> None:
    if not isinstance(args.model, str | os.PathLike) or not str(args.model):
        raise ValueError(f"model must be a non-empty path, got {args.model!r}")
    # NOTE: the only in-place normalisation of this frozen object: PathLike -> str.
    object.__setattr__(args, "model", os.fspath(args.model))
    if not os.path.isdir(args.model):
        raise ValueError(
            f"model must be a local checkpoint folder (no hub downloads): {args.model!r} "
            "is not a directory"
        )
    if args.tokenizer is not None and not os.path.isdir(str(args.tokenizer)):
        raise ValueError(f"tokenizer must be a local folder, got {args.tokenizer!r}")


def validate_mm_limits(args: LlmArgs) -> None:
    limits = args.limit_mm_per_prompt
    if limits is None:
        return
    if not isinstance(limits, dict):
        raise ValueError(f"limit_mm_per_prompt must be a dict, got {type(limits).__name__}")
    for key, value in limits.items():
        check_choice("limit_mm_per_prompt key", key, MODALITIES)
        check_int(f"limit_mm_per_prompt[{key!r}]", value, 0)


def normalize_cuda_graph_config(args: LlmArgs) -> None:
    config = args.cuda_graph_config
    if isinstance(config, dict):
        known = {"batch_sizes", "max_batch_size", "enable_padding", "piecewise_max_tokens"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown cuda_graph_config field(s) {unknown}")
        config = CudaGraphConfig(**config)
        object.__setattr__(args, "cuda_graph_config", config)
    if config is None:
        return
    if not isinstance(config, CudaGraphConfig):
        raise ValueError(
            f"cuda_graph_config must be a CudaGraphConfig, a dict or None, got {config!r}"
        )
    if (config.piecewise_max_tokens or 0) > args.max_num_tokens:
        raise ValueError(
            f"cuda_graph_config.piecewise_max_tokens {config.piecewise_max_tokens} exceeds "
            f"max_num_tokens {args.max_num_tokens}"
        )
    # With max_batch_size sized at startup, the engine checks the captured sizes then.
    if args.max_batch_size is not None and config.largest(args.max_batch_size) > (
        args.max_batch_size
    ):
        raise ValueError(
            f"cuda_graph_config captures batch size {config.largest(args.max_batch_size)}, "
            f"more than max_batch_size {args.max_batch_size}"
        )


def check_triton_device(device_type: str) -> None:
    """attn_backend 'triton' off CUDA: the kernels have no CPU driver (only Triton's
    interpreter, TRITON_INTERPRET=1, runs them there, as the tests do)."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"attn_backend 'triton' runs on CUDA only, not on {device_type} (or under "
            "TRITON_INTERPRET=1); use attn_backend 'auto' or 'vanilla' there"
        )


def note_unused_device_knobs(args: LlmArgs, device_type: str, attn_backend: str) -> None:
    """Log the knobs given that this device does not use, so none is a silent no-op: the CPU
    KV cache holds a full batch at max_seq_len (not a share of free memory), and decode CUDA
    graphs need CUDA with a capturable attention backend."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    default_fraction = defaults["kv_cache_free_gpu_memory_fraction"]
    fraction = args.kv_cache_free_gpu_memory_fraction
    if device_type != "cuda" and fraction != default_fraction:
        logger.warning(
            "kv_cache_free_gpu_memory_fraction=%s has no effect on %s: the KV cache holds "
            "max_batch_size x max_seq_len tokens there; cap it with kv_cache_max_tokens "
            "(kv_cache_config.max_tokens) instead",
            fraction,
            device_type,
        )
    graphs = args.cuda_graph_config
    if graphs is not None and graphs != CudaGraphConfig():
        if device_type != "cuda" or attn_backend == "vanilla":
            logger.warning(
                "cuda_graph_config is not used: CUDA graphs need CUDA and the triton or "
                "flash_attn attention backend (here: %s, %s)",
                device_type,
                attn_backend,
            )
