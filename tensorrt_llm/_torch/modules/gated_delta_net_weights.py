"""Gated DeltaNet checkpoint layouts: which HF projections fill our fused ones, the
Qwen3-Next (rows grouped per key head) -> Qwen3.5 (contiguous) rewrite, and the checkpoint
rows one tensor-parallel rank holds (`gdn_rank_shards`; for Qwen3-Next, the same rows of the
rewritten layout, read from the grouped tensor through `RowGather`).

NOTE: `in_proj_ba` stays its own `Linear` rather than joining `in_proj_qkvz` at load time:
block-FP8 releases keep `in_proj_a` / `in_proj_b` in 16 bits (`quantization.py`'s defaults)
while qkv/z are FP8, and one `Linear` is either all block-FP8 or all 16-bit. With 16-bit weights
the layer joins the two once after loading (`fuse_in_projections_`, run by the engine's
`build_model` over every layer: `gated_delta_net.fuse_gdn_in_projections_`), one GEMM per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...mapping import Mapping as ParallelMapping
from ..checkpoint_slices import RowGather
from ..distributed import MultiRangeShard, TensorShard, column_shard
from .linear import Linear
from .tensor_parallel import TensorParallelMode

if TYPE_CHECKING:
    from .gated_delta_net import GatedDeltaNet

# our fused projection -> the Qwen3.5 HF projections stacked along the output dim, in order
GATED_DELTA_NET_FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}


def qwen3_next_gdn_row_ranges(
    leaf: str, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> dict[str, tuple[tuple[int, int], ...]]:
    """Where each Qwen3.5 projection's rows sit in a Qwen3-Next grouped one: Qwen3.5 name
    (relative, e.g. "in_proj_qkv") -> `(start, length)` rows of the grouped tensor, in order.

    `in_proj_qkvz` holds one group per key head g, `G = 2*dk + 2*r*dv` rows (r = V/K):
    `[q_g (dk) | k_g (dk) | v_g (r*dv) | z_g (r*dv)]`, and `in_proj_ba` one of `2*r` rows,
    `[b_g (r) | a_g (r)]`. Key head g owns value heads `g*r ... g*r + r - 1`, so the contiguous
    `in_proj_qkv = [q_0..q_K-1 | k_0.. | v_0..]` takes q_g, then k_g, then v_g of every
    group; a tensor-parallel rank's key heads are whole groups and its rows of the result
    (`gdn_rank_shards`) map back to its groups' rows only."""
    r = num_v_heads // num_k_heads
    groups = range(num_k_heads)
    if leaf == "qkvz":
        g_rows = 2 * head_k_dim + 2 * r * head_v_dim
        q = tuple((g * g_rows, head_k_dim) for g in groups)
        k = tuple((g * g_rows + head_k_dim, head_k_dim) for g in groups)
        v = tuple((g * g_rows + 2 * head_k_dim, r * head_v_dim) for g in groups)
        z = tuple((g * g_rows + 2 * head_k_dim + r * head_v_dim, r * head_v_dim) for g in groups)
        return {"in_proj_qkv": q + k + v, "in_proj_z": z}
    return {
        "in_proj_b": tuple((g * 2 * r, r) for g in groups),
        "in_proj_a": tuple((g * 2 * r + r, r) for g in groups),
    }


def convert_qwen3_next_gdn_weights(
    weights: Mapping[str, Any],
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> dict[str, Any]:
    """Rewrite Qwen3-Next `*in_proj_qkvz.weight` / `*in_proj_ba.weight` (rows grouped per key
    head, `qwen3_next_gdn_row_ranges`) into Qwen3.5's contiguous `in_proj_qkv`, `in_proj_z`,
    `in_proj_b`, `in_proj_a`. Other entries pass through.

    A loaded tensor is regrouped at once; a lazy one (`LazyTensor`, a tensor-parallel load)
    becomes a `RowGather` view, so the loader's shard of it reads only this rank's groups."""
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition("in_proj_")
        grouped = prefix == "" or prefix.endswith(".")
        if grouped and leaf in ("qkvz.weight_scale_inv", "ba.weight_scale_inv"):
            raise ValueError(
                f"{name}: block-FP8 Qwen3-Next checkpoints (grouped in_proj_qkvz / in_proj_ba "
                "scales) are not supported yet"
            )
        if leaf not in ("qkvz.weight", "ba.weight") or not grouped:
            out[name] = tensor
            continue
        kind = leaf.split(".")[0]
        ranges = qwen3_next_gdn_row_ranges(kind, num_k_heads, num_v_heads, head_k_dim, head_v_dim)
        rows = sum(n for parts in ranges.values() for _, n in parts)
        if len(tensor.shape) != 2 or tensor.shape[0] != rows:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}; expected {rows} rows for "
                f"{num_k_heads} key heads"
            )
        for target, parts in ranges.items():
            view = RowGather(tensor, parts)
            out[f"{prefix}{target}.weight"] = (
                view.materialize() if isinstance(tensor, torch.Tensor) else view
            )
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


def fuse_in_projections_(gdn: GatedDeltaNet) -> bool:
    """Join a layer's `[in_proj_qkvz; in_proj_ba]` into one weight, so a step runs one GEMM
    instead of two (plus the small one's split-K reduce): ~6 us per layer at batch 1 on the
    H200. Sets `gdn.in_proj_fused`; returns whether the two are joined.

    Only for plain 16-bit weights on the Triton-capable path (`kernel_backend` not "torch"):
    block-FP8 releases keep in_proj_a/b in 16 bits while qkv/z are FP8, so those stay two
    GEMMs. The two weights move into one tensor and both parameters become views of it (no
    extra memory; later loads write through the views).

    NOTE: a post-load step, run once after the weights are loaded and any quantization is
    applied, before any CUDA-graph capture or torch.compile trace (whose recordings keep
    weight addresses); the forward only reads `in_proj_fused`. Whoever replaces the weights
    afterwards (quantizes, moves them) runs it again: it re-checks and re-joins or drops."""
    if torch.compiler.is_compiling() or (
        gdn.in_proj_qkvz.weight.is_cuda and torch.cuda.is_current_stream_capturing()
    ):
        raise RuntimeError(
            "fuse_in_projections_ is a post-load step: it moves the weights, which a CUDA-graph "
            "capture or a torch.compile trace would keep the old addresses of"
        )
    qkvz, ba = gdn.in_proj_qkvz.weight, gdn.in_proj_ba.weight
    current, gdn.in_proj_fused = gdn.in_proj_fused, None
    plain = all(
        lin.fp8_block is None and lin.bias is None and not lin.reduce_output
        for lin in (gdn.in_proj_qkvz, gdn.in_proj_ba)
    )
    if (
        gdn.kernel_backend == "torch"
        or not plain
        or qkvz.dtype not in (torch.bfloat16, torch.float16, torch.float32)
        or ba.dtype != qkvz.dtype
        or ba.device != qkvz.device
        or qkvz.is_meta
    ):
        return False  # (a join left from before stays as views: same values, same memory)
    if current is not None:
        split = current.data_ptr() + qkvz.numel() * current.element_size()
        if qkvz.data_ptr() == current.data_ptr() and ba.data_ptr() == split:
            gdn.in_proj_fused = current  # joined already: both are still views of it
            return True
    with torch.no_grad():
        fused = torch.cat([qkvz.detach(), ba.detach()])
    qkvz.data, ba.data = fused[: qkvz.shape[0]], fused[qkvz.shape[0] :]
    gdn.in_proj_fused = fused
    return True
