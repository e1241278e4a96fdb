"""TensorRT-LLM's spellings of `LLM` arguments: `KvCacheConfig`, `backend`,
`tensor_parallel_size`, `pipeline_parallel_size`.

They map onto `LlmArgs`' own fields, so one validation applies; a value this project does not
implement yet (pipeline parallelism, another backend) is a clear error, never a silent no-op.
`tensor_parallel_size` becomes the engine's `Mapping` (`engine_mapping`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..mapping import Mapping

if TYPE_CHECKING:
    from .llm_args import LlmArgs

BACKENDS = ("pytorch",)


@dataclass(frozen=True, init=False)
class KvCacheConfig:
    """The KV cache knobs under TensorRT-LLM's names (`LLM(kv_cache_config=...)`).

    free_gpu_memory_fraction: -> `kv_cache_free_gpu_memory_fraction` (None: 0.9).
    max_tokens: -> `kv_cache_max_tokens` (None: sized from memory only).
    dtype: -> `kv_cache_dtype` ("auto" or "fp8").
    tokens_per_block: -> `tokens_per_block` (None: 32).
    enable_block_reuse: -> `enable_block_reuse` (prefix caching; None: on for full-attention
      models, off for now for hybrid ones, where True adds recurrent-state snapshots).
    mamba_ssm_cache_dtype: -> `mamba_ssm_cache_dtype` (hybrid models' DeltaNet state: "auto"
      is the checkpoint's `mamba_ssm_dtype`, else float32; "bfloat16" / "float16" halve its bytes).
    """

    free_gpu_memory_fraction: float | None = None
    max_tokens: int | None = None
    dtype: str = "auto"
    tokens_per_block: int | None = None
    enable_block_reuse: bool | None = None
    mamba_ssm_cache_dtype: str = "auto"

    def __init__(
        self,
        free_gpu_memory_fraction: float | None = None,
        max_tokens: int | None = None,
        dtype: str = "auto",
        tokens_per_block: int | None = None,
        enable_block_reuse: bool | None = None,
        mamba_ssm_cache_dtype: str = "auto",
        **unsupported: Any,
    ) -> None:
        # Upstream's KvCacheConfig has more knobs (partial reuse, host offload, attention
        # windows, ...): code ported from it gets their names back, not a bare TypeError.
        if unsupported:
            raise ValueError(_unsupported_kv_fields(unsupported))
        values = {
            "free_gpu_memory_fraction": free_gpu_memory_fraction,
            "max_tokens": max_tokens,
            "dtype": dtype,
            "tokens_per_block": tokens_per_block,
            "enable_block_reuse": enable_block_reuse,
            "mamba_ssm_cache_dtype": mamba_ssm_cache_dtype,
        }
        for field, value in values.items():
            object.__setattr__(self, field, value)  # frozen


def _unsupported_kv_fields(unsupported: dict[str, Any]) -> str:
    return (
        f"unknown kv_cache_config field(s) {sorted(unsupported)}: not supported by this "
        f"engine; supported: {sorted(_KV_FIELDS)}"
    )


# KvCacheConfig field -> (LlmArgs field, LlmArgs default)
_KV_FIELDS = {
    "free_gpu_memory_fraction": "kv_cache_free_gpu_memory_fraction",
    "max_tokens": "kv_cache_max_tokens",
    "dtype": "kv_cache_dtype",
    "tokens_per_block": "tokens_per_block",
    "enable_block_reuse": "enable_block_reuse",
    "mamba_ssm_cache_dtype": "mamba_ssm_cache_dtype",
}


def _kv_cache_config(value: Any) -> KvCacheConfig:
    if isinstance(value, KvCacheConfig):
        return value
    if isinstance(value, dict):
        return KvCacheConfig(**value)
    raise ValueError(f"kv_cache_config must be a KvCacheConfig, a dict or None, got {value!r}")


def engine_mapping(args: LlmArgs) -> Mapping:
    """The engine's rank layout: rank 0 of `tensor_parallel_size` ranks on this node, or of
    the torchrun job this process is part of (its nodes' sizes: `executor/torchrun.py`)."""
    from ..executor.torchrun import torchrun_job, torchrun_mapping

    size = args.tensor_parallel_size
    job = torchrun_job(size)
    if job is not None:
        return torchrun_mapping(size, job)
    return Mapping(world_size=size, rank=0, tp_size=size)


def apply_upstream_fields(args: LlmArgs) -> None:
    """Check `backend` and the parallel sizes, and move `kv_cache_config`'s values onto the
    flat fields (called from `LlmArgs.__post_init__`, before those are validated)."""
    if args.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {args.backend!r}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = getattr(args, name)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an int >= 1, got {size!r}")
        if size > 1 and name == "pipeline_parallel_size":
            raise ValueError(f"{name}={size}: pipeline parallelism is not supported yet")
    if args.mm_encoder_tp_mode != "data":
        raise ValueError(
            f"mm_encoder_tp_mode={args.mm_encoder_tp_mode!r}: only 'data' (each rank encodes a "
            "share of the step's images) is supported"
        )
    if args.tensor_parallel_size > 1 and args.executor_mode != "process":
        raise ValueError(
            f"tensor_parallel_size={args.tensor_parallel_size} needs executor_mode='process' "
            "(the engine process is rank 0 and starts the other ranks)"
        )
    if args.kv_cache_config is None:
        return
    config = _kv_cache_config(args.kv_cache_config)
    defaults = {f.name: f.default for f in dataclasses.fields(type(args))}
    for ours, flat in _KV_FIELDS.items():
        value = getattr(config, ours)
        if value is None or value == getattr(KvCacheConfig, ours):
            continue
        current = getattr(args, flat)
        if current != defaults[flat] and current != value:
            raise ValueError(
                f"kv_cache_config.{ours}={value!r} and {flat}={current!r} disagree; give one"
            )
        object.__setattr__(args, flat, value)
    object.__setattr__(args, "kv_cache_config", config)
