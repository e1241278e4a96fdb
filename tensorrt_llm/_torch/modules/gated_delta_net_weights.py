"""Gated DeltaNet checkpoint layouts: which HF projections fill our fused ones, the
Qwen3-Next (rows grouped per key head) -> Qwen3.5 (contiguous) rewrite, and the checkpoint
rows one tensor-parallel rank holds (`gdn_rank_shards`).

NOTE: `in_proj_ba` stays its own `Linear` rather than joining `in_proj_qkvz` at load time:
block-FP8 releases keep `in_proj_a` / `in_proj_b` in 16 bits (`quantization.py`'s defaults)
while qkv/z are FP8, and one `Linear` is either all block-FP8 or all 16-bit. With 16-bit weights
the layer joins the two after loading (`GatedDeltaNet._in_proj_weight`), one GEMM per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...mapping import Mapping as ParallelMapping
from ..distributed import MultiRangeShard, TensorShard, column_shard
from .linear import Linear
from .tensor_parallel import TensorParallelMode

# our fused projection -> the Qwen3.5 HF projections stacked along the output dim, in order
GATED_DELTA_NET_FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}


def convert_qwen3_next_gdn_weights(
    weights: Mapping[str, torch.Tensor],
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> dict[str, torch.Tensor]:
    """Rewrite Qwen3-Next `*in_proj_qkvz.weight` / `*in_proj_ba.weight` (rows grouped per key
    head: [q_h, k_h, v_h.., z_h..] and [b_h.., a_h..]) into Qwen3.5's contiguous
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`. Other entries pass through."""
    ratio = num_v_heads // num_k_heads
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition("in_proj_")
        if leaf not in ("qkvz.weight", "ba.weight") or (prefix and not prefix.endswith(".")):
            out[name] = tensor
            continue
        if leaf == "qkvz.weight":
            sizes = [head_k_dim, head_k_dim, ratio * head_v_dim, ratio * head_v_dim]
        else:
            sizes = [ratio, ratio]
        if tensor.dim() != 2 or tensor.shape[0] != num_k_heads * sum(sizes):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}; expected {num_k_heads * sum(sizes)} "
                f"rows for {num_k_heads} key heads"
            )
        grouped = tensor.reshape(num_k_heads, sum(sizes), tensor.shape[1])
        parts = [p.reshape(-1, tensor.shape[1]) for p in grouped.split(sizes, dim=1)]
        if leaf == "qkvz.weight":
            out[prefix + "in_proj_qkv.weight"] = torch.cat(parts[:3])
            out[prefix + "in_proj_z.weight"] = parts[3]
        else:
            out[prefix + "in_proj_b.weight"], out[prefix + "in_proj_a.weight"] = parts
    return out


@dataclass(frozen=True)
class GdnRankShards:
    """One rank's share of a Gated DeltaNet layer: key heads `K/tp` with their value heads
    `V/tp` (value head j reads key head `j // (V/K)`, so both ranges are contiguous)."""

    num_k_heads: int
    num_v_heads: int
    qkv: MultiRangeShard  # rows of in_proj_qkv and channels of conv1d: this rank's q, k, v
    z: TensorShard  # rows of in_proj_z (value channels)
    heads: TensorShard  # rows of in_proj_b / in_proj_a, entries of dt_bias / A_log


def gdn_rank_shards(
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    mapping: ParallelMapping,
) -> GdnRankShards | None:
    """The checkpoint slices of this rank (None without tensor parallelism). The channel
    layout `[q (K*dk) | k (K*dk) | v (V*dv)]` puts a rank's q, k and v rows in three separate
    ranges, read and joined in that order, so the rank's conv and split see the local layout."""
    if not mapping.has_tp:
        return None
    tp, rank = mapping.tp_size, mapping.tp_rank
    k = column_shard(num_k_heads, tp, rank, "linear_num_key_heads")
    v = column_shard(num_v_heads, tp, rank, "linear_num_value_heads")
    key_dim = num_k_heads * head_k_dim
    qkv = MultiRangeShard(
        0,
        (
            (k.start * head_k_dim, k.length * head_k_dim),
            (key_dim + k.start * head_k_dim, k.length * head_k_dim),
            (2 * key_dim + v.start * head_v_dim, v.length * head_v_dim),
        ),
    )
    z = TensorShard(0, v.start * head_v_dim, v.length * head_v_dim)
    return GdnRankShards(k.length, v.length, qkv, z, v)


def gdn_projections(
    hidden_size: int,
    conv_dim: int,
    value_dim: int,
    num_v_heads: int,
    tp: GdnRankShards | None,
    mapping: ParallelMapping,
    dtype: torch.dtype | None,
) -> tuple[Linear, Linear, Linear]:
    """`in_proj_qkvz` ([q | k | v | z]), `in_proj_ba` ([b | a]) and `out_proj` of a layer
    whose sizes (`conv_dim`, ...) are this rank's: with `tp`, the Linears are built from the
    full sizes and hold the rank's rows (COLUMN, by `tp`'s shards) and columns (ROW)."""
    tp_size = mapping.tp_size if tp is not None else 1
    full_conv, full_value, full_v = conv_dim * tp_size, value_dim * tp_size, num_v_heads * tp_size
    col = row = None
    if tp is not None:
        col, row = TensorParallelMode.COLUMN, TensorParallelMode.ROW
    in_proj_qkvz = Linear(
        hidden_size,
        full_conv + full_value,
        dtype=dtype,
        output_splits=(full_conv, full_value),
        mapping=mapping,
        tensor_parallel_mode=col,
        output_shards=None if tp is None else (tp.qkv, tp.z),
    )
    in_proj_ba = Linear(
        hidden_size,
        2 * full_v,
        dtype=dtype,
        output_splits=(full_v, full_v),
        mapping=mapping,
        tensor_parallel_mode=col,
        output_shards=None if tp is None else (tp.heads, tp.heads),
    )
    out_proj = Linear(
        full_value, hidden_size, dtype=dtype, mapping=mapping, tensor_parallel_mode=row
    )
    return in_proj_qkvz, in_proj_ba, out_proj
