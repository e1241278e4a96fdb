"""Shared constructor of the attention backends: head layout, layer index and softmax scale."""

from __future__ import annotations

import torch

from ..modules.triton_kernels.fp8_quant import FP8_MAX


class AttentionShape:
    """Validated head layout of one attention layer, the common base of the backends.

    `num_heads` query heads share `num_kv_heads` K/V heads (GQA), each of width `head_dim`;
    `scale` defaults to `head_dim ** -0.5`.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        scale: float | None = None,
    ) -> None:
        if num_heads <= 0 or num_kv_heads <= 0 or head_dim <= 0:
            raise ValueError(
                f"invalid attention shape: heads={num_heads}, kv_heads={num_kv_heads}, "
                f"head_dim={head_dim}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5 if scale is None else scale


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` converted for storage in a KV cache of `cache_dtype`. The FP8 cache stores K/V
    unscaled and clamps to e4m3's largest value, so an outlier saturates instead of turning
    into NaN."""
    if cache_dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return x.to(cache_dtype)
