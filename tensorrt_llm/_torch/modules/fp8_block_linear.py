"""Block-FP8 linear layers as the Qwen `-FP8` releases store them: e4m3 `weight [N, K]` plus
fp32 `weight_scale_inv`, activations quantized per 1 x bk token group at run time.

A `Linear` in this mode (`Linear.to_fp8_block_`) holds its scales either in the checkpoint's
block grid `[ceil(N/bn), ceil(K/bk)]` or, for a fused projection (qkv, gate_up) with a shard
that does not end on a `bn` boundary, row-granular (`bn = 1`, `[N, ceil(K/bk)]`): each shard
keeps its own partial last block exactly, which concatenated block scales could not.

Tensor parallelism splits whole blocks only (`shard_block_scales`): a column shard reads its
out-block rows of the scales, a row shard its in-block columns, with its weight slice.

`fp8_block_forward` is the one place the layers call the GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..distributed import AnyShard, MultiRangeShard, TensorShard
from .fp8_block_cublas import choose_block_gemm, cublas_block_fp8_gemm
from .fp8_linear import Fp8Activation, padded_rows
from .triton_kernels.fp8_block import (
    FP8_DTYPE,
    block_fp8_gemm,
    check_block_scales,
    fp8_block_linear,
    per_token_group_quant_fp8,
    quantize_weight_fp8_block,
)


def fp8_block_forward(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int],
) -> torch.Tensor:
    """`x @ dequant(weight)^T + bias` in `x.dtype`: the one call of the block GEMM (on CUDA
    Triton or cuBLASLt, `choose_block_gemm`; the torch reference elsewhere). `x` may come
    quantised per 1 x bk group by its producer (`Fp8Activation`, rows padded to 16)."""
    n, k = weight.shape
    if isinstance(x, Fp8Activation):
        if x.q.is_cuda and choose_block_gemm(x.q.device, x.rows, n, k, block) == "cublas":
            out = cublas_block_fp8_gemm(x.q, x.scale, weight, scale_inv, x.dtype, bias)
            return out[: x.rows]
        xq, x_scale = x.q[: x.rows], x.scale[: x.rows]
        return block_fp8_gemm(xq, x_scale, weight, scale_inv, x.dtype, block, bias=bias)
    if x.is_cuda:
        rows = x.reshape(-1, x.shape[-1])
        if choose_block_gemm(x.device, rows.shape[0], n, k, block) == "cublas":
            # cuBLASLt wants a multiple of 16 rows: the padding rows quantise to zeros.
            xq, x_scale = per_token_group_quant_fp8(
                rows, block[1], m_major=True, rows_out=padded_rows(rows.shape[0])
            )
            out = cublas_block_fp8_gemm(xq, x_scale, weight, scale_inv, x.dtype, bias)
            return out[: rows.shape[0]].reshape(*x.shape[:-1], n)
    return fp8_block_linear(x, weight, scale_inv, bias, block, backend="auto")


def scale_rows(splits: Sequence[int], block: tuple[int, int]) -> int:
    """The `bn` a layer of these output shards keeps: the checkpoint's when every shard but
    the last ends on a block boundary (its block scales concatenate), else 1 (per row)."""
    bn = block[0]
    return bn if all(s % bn == 0 for s in splits[:-1]) else 1


def shard_block_scales(
    name: str,
    weight_shards: Sequence[AnyShard | None],
    full_splits: Sequence[int],
    full_in_features: int,
    rows: bool,
    block: tuple[int, int],
    tp_size: int,
) -> tuple[AnyShard | None, ...]:
    """The `weight_scale_inv` slice of each checkpoint part that goes with its weight slice:
    the out-block rows of a column shard (`rows`), the in-block columns of a row shard.

    Only whole blocks split: a shard must start on a block boundary and hold whole blocks
    (or the part's last, partial one). Anything else would need scales the checkpoint does
    not have (a block's one scale covers rows two ranks hold), so it is a ValueError naming
    the layer and its sizes; the releases' 128-blocks split whenever the per-rank heads and
    channels are multiples of 128."""
    b = block[0] if rows else block[1]
    out: list[AnyShard | None] = []
    for i, shard in enumerate(weight_shards):
        if shard is None:
            out.append(None)
            continue
        full = full_splits[i] if rows else full_in_features
        # A multi-range shard (Gated DeltaNet's q, k, v rows): each range as its own shard.
        ranges = (
            shard.ranges if isinstance(shard, MultiRangeShard) else ((shard.start, shard.length),)
        )
        blocks = []
        for start, length in ranges:
            end = start + length
            if start % b or (length % b and end != full):
                what = f"output part {i} ({full} rows)" if rows else f"in_features ({full} columns)"
                raise ValueError(
                    f"{name}: tensor_parallel_size={tp_size} gives this rank "
                    f"{'rows' if rows else 'columns'} [{start}, {end}) of {what}, not whole "
                    f"{b}-blocks of the block-FP8 weight_scale_inv {block}; the per-rank share "
                    f"must be a multiple of {b}"
                )
            blocks.append((start // b, -(-length // b)))
        if isinstance(shard, MultiRangeShard):
            out.append(MultiRangeShard(shard.dim, tuple(blocks)))
        else:
            out.append(TensorShard(shard.dim, *blocks[0]))
    return tuple(out)


def merge_shard_scales(
    shards: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    block: tuple[int, int],
    layer_bn: int,
) -> torch.Tensor:
    """One scale tensor for the fused weight `cat(shards)` from each shard's block scales."""
    if layer_bn == block[0]:
        return torch.cat(list(scales), dim=0)
    # Row-granular: row n of a shard reads block row n // bn of that shard's own grid.
    rows = [
        s.repeat_interleave(block[0], dim=0)[: w.shape[0]]
        for w, s in zip(shards, scales, strict=True)
    ]
    return torch.cat(rows, dim=0)


def quantize_shards(
    shards: Sequence[torch.Tensor], block: tuple[int, int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each 16-bit shard quantized on its own by the releases' rule (per block amax / 448)."""
    pairs = [quantize_weight_fp8_block(w, block) for w in shards]
    return [q for q, _ in pairs], [s for _, s in pairs]


def check_shards(
    name: str,
    shards: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor] | None,
    splits: Sequence[int],
    in_features: int,
    block: tuple[int, int],
    quantize_on_load: bool,
) -> None:
    """A ValueError unless the checkpoint tensors fit a block-FP8 layer (see `load_fp8_block`)."""
    if len(shards) != len(splits) or (scales is not None and len(scales) != len(shards)):
        got = "no" if scales is None else len(scales)
        raise ValueError(f"{name}: {len(shards)} weights, {got} scales for splits {tuple(splits)}")
    dtypes = {w.dtype for w in shards}
    if len(dtypes) != 1:
        raise ValueError(f"{name}: its shards mix dtypes {sorted(map(str, dtypes))}")
    for w, rows in zip(shards, splits, strict=True):
        if tuple(w.shape) != (rows, in_features):
            raise ValueError(
                f"{name}: checkpoint shard {tuple(w.shape)} vs model {(rows, in_features)}"
            )
    fp8 = shards[0].dtype == FP8_DTYPE
    if fp8 and scales is None:
        raise ValueError(f"{name}: e4m3 weights without their weight_scale_inv")
    if not fp8 and scales is not None:
        raise ValueError(f"{name}: weight_scale_inv given with a {shards[0].dtype} weight")
    if not fp8 and not quantize_on_load:
        raise ValueError(
            f"{name}: the checkpoint stores this layer in {shards[0].dtype}, but its "
            "quantization_config does not list it in modules_to_not_convert (block-FP8 expected)"
        )
    for i, (w, s) in enumerate(zip(shards, scales or (), strict=False)):  # (none: no scales)
        if s.dtype != torch.float32:
            raise ValueError(f"{name}: weight_scale_inv must be float32, got {s.dtype}")
        check_block_scales(w, s, block, f"{name} (shard {i})")


@torch.no_grad()
def load_fp8_block(
    name: str,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    shards: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor] | None,
    splits: Sequence[int],
    block: tuple[int, int],
    layer_bn: int,
    quantize_on_load: bool,
) -> None:
    """Fill a block-FP8 layer's `weight`/`scale_inv` from its checkpoint shards.

    `block` is the checkpoint's (per shard), `layer_bn` the row count of the layer's scale
    blocks (`scale_rows`). e4m3 shards need their fp32 scales; 16-bit shards (no scales) are
    quantized here, one shard at a time, when `quantize_on_load` (quantization="fp8_block" on
    a 16-bit checkpoint, or random weights). Anything else is a ValueError naming the layer.
    """
    check_shards(name, shards, scales, splits, weight.shape[1], block, quantize_on_load)
    if scales is None:
        shards, scales = quantize_shards([w.to(weight.device) for w in shards], block)
    merged = merge_shard_scales(shards, scales, block, layer_bn)
    if merged.shape != scale_inv.shape:
        raise ValueError(
            f"{name}: merged weight_scale_inv {tuple(merged.shape)} vs model "
            f"{tuple(scale_inv.shape)}"
        )
    weight.copy_(torch.cat(list(shards), dim=0) if len(shards) > 1 else shards[0])
    scale_inv.copy_(merged)
