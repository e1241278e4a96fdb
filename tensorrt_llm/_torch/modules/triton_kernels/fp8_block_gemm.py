"""The block-scaled FP8 GEMM of `fp8_block.py` in Triton: `(xq * x_scale) @ (wq * w_scale_inv)^T`
with e4m3 operands, 1 x bk activation scales and bn x bk weight scales, its tile table and its
split-K plan for decode sizes.

Every row count (M) is a runtime argument (`do_not_specialize`), and the tile choice depends
only on the M bucket of `_GEMM_TILES`, so a batch size seen for the first time while serving
reuses a variant compiled at warm-up (graph capture covers every bucket) instead of stalling the
step on a compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit


@triton_jit(do_not_specialize=("rows", "tiles_per_split"))
def _block_fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, bias_ptr,
    rows, cols, depth, tiles_per_split,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm, stride_cs,
    W_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid: (cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M), splits). A [M, K] e4m3 with scales
    # [M, K/BK], B [N, K] e4m3 with scales [N / W_BLOCK_N, K/BK]; BLOCK_K is the scale block,
    # so each K tile is one exact fp8 dot rescaled by its row and column scales in fp32.
    # Programs walk GROUP_M row tiles down before moving right, so that at prefill sizes the
    # weight tiles a wave reads stay in L2 for the next row tiles (GROUP_M = 1: N fastest).
    # With splits > 1, program z sums K tiles [z * tiles_per_split, ...) into fp32 partials
    # at c + z * stride_cs, which `_split_k_sum_kernel` adds up.
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(cols, BLOCK_N)
    m_tiles = tl.cdiv(rows, BLOCK_M)
    per_group = GROUP_M * n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    mask_m = offs_m < rows
    mask_n = offs_n < cols
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm
    b_scale_ptrs = b_scale_ptr + (offs_n // W_BLOCK_N) * stride_bsn
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(depth, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        mask_k = offs_k < depth - k0
        a = tl.load(a_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs + tile * stride_ask, mask=mask_m, other=0.0)
        b_scale = tl.load(b_scale_ptrs + tile * stride_bsk, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + split * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton_jit(do_not_specialize=("rows", "tiles_per_split"))
def _block_fp8_gemm_swap_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, bias_ptr,
    rows, cols, depth, tiles_per_split,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm, stride_cs,
    W_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # `_block_fp8_gemm_kernel` with the operands swapped, for decode row counts: the tile is
    # C^T = W_tile [BLOCK_N, BK] @ X_tile^T [BK, BLOCK_M], so the weight rows fill the MMA's
    # long side (64+ rows on Hopper) and the few tokens its short one, instead of padding a
    # handful of tokens up to the MMA height. grid: (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M),
    # splits); split-K partials as in the other kernel.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    mask_m = offs_m < rows
    mask_n = offs_n < cols
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    x_ptrs = a_ptr + offs_m[None, :] * stride_am + offs_k[:, None]
    x_scale_ptrs = a_scale_ptr + offs_m * stride_asm
    w_scale_ptrs = b_scale_ptr + (offs_n // W_BLOCK_N) * stride_bsn
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(depth, BLOCK_K))
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        mask_k = offs_k < depth - k0
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        x_scale = tl.load(x_scale_ptrs + tile * stride_ask, mask=mask_m, other=0.0)
        w_scale = tl.load(w_scale_ptrs + tile * stride_bsk, mask=mask_n, other=0.0)
        acc += tl.dot(w, x) * w_scale[:, None] * x_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + split * stride_cs + offs_m[None, :] * stride_cm + offs_n[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


@triton_jit(do_not_specialize=("rows", "splits"))
def _split_k_sum_kernel(
    part_ptr, out_ptr, bias_ptr, rows, cols, splits, stride_ps, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid: (rows, cdiv(cols, BLOCK)); partials [splits, rows, cols] fp32, contiguous rows.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * stride_ps + row * cols + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemmTiles:
    """One row of `_GEMM_TILES`: the launch of `_block_fp8_gemm_kernel` for an M bucket."""

    max_rows: int  # the bucket holds M <= max_rows (the last bucket: any M)
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: bool  # whether K may be split when the output tiles leave SMs idle
    group_m: int = 1  # row tiles walked down before moving right (L2 reuse of weight tiles)
    swap_ab: bool = False  # `_block_fp8_gemm_swap_kernel` (weights on the MMA's long side)


# Keyed on M. Decode buckets (M <= 256) are bound by the weight read, so their tiles are short
# in M and, when N / BLOCK_N x M / BLOCK_M output tiles cannot fill the SMs, K is split so that
# every SM streams part of the weight. Up to 32 rows the swapped-operand kernel is faster (20%
# at 32 rows over Qwen3-VL-8B's projections); at 64 the plain one. Chosen with
# `benchmarks/tune_fp8_block.py` on the H200 (the least total time over the projections per
# bucket; benchmarks/results/fp8_block_gemm_h200.md). From 65 rows on, cuBLASLt runs instead
# where it can (`fp8_block_cublas.CUBLAS_MIN_ROWS`); the larger buckets serve the other shapes.
_GEMM_TILES = (
    GemmTiles(16, 16, 64, 4, 5, True, swap_ab=True),
    GemmTiles(32, 32, 64, 4, 4, True, swap_ab=True),
    GemmTiles(64, 64, 64, 4, 4, True),
    GemmTiles(128, 64, 64, 4, 4, True),
    GemmTiles(256, 64, 128, 4, 3, True),
    GemmTiles(1 << 62, 64, 128, 4, 3, False, 8),
)
_MAX_SPLITS = 16
_INTERPRETER_SMS = 132  # an H100/H200's SM count, so CPU tests exercise the same split logic


def gemm_tiles(rows: int) -> GemmTiles:
    """The `_GEMM_TILES` bucket of a GEMM with `rows` rows."""
    return next(t for t in _GEMM_TILES if rows <= t.max_rows)


@cache
def num_sms(device: torch.device) -> int:
    """The SM count the split-K plan fills (the interpreter's stand-in on the CPU)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_plan(tiles: GemmTiles, cols: int, k_tiles: int, sms: int) -> tuple[int, int]:
    """(splits, K tiles per split) for a GEMM of `cols` output columns and `k_tiles` K tiles.

    NOTE: computed from the bucket's largest M, not the actual one, so every M of a bucket
    launches the same kernel variant (a split GEMM writes fp32 partials, another variant).
    """
    m_tiles = -(-min(tiles.max_rows, 1 << 20) // tiles.block_m)
    out_tiles = m_tiles * -(-cols // tiles.block_n)
    if not tiles.split_k or out_tiles >= sms or k_tiles < 2:
        return 1, k_tiles
    splits = min(_MAX_SPLITS, k_tiles, -(-sms // out_tiles))
    return fixed_split(k_tiles, splits)


def fixed_split(k_tiles: int, splits: int) -> tuple[int, int]:
    """(splits, K tiles per split) closest to `splits` with no empty split."""
    per_split = -(-k_tiles // max(1, min(splits, k_tiles)))
    return -(-k_tiles // per_split), per_split


def triton_block_fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    tiles: GemmTiles | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """The Triton path of `fp8_block.block_fp8_gemm` (arguments checked there). `tiles` and
    `splits` override the table's launch (the tuning script measures alternatives)."""
    bn, block_k = block
    rows, depth = xq.shape
    cols = wq.shape[0]
    if wq.stride(1) != 1 or xq.stride(1) != 1:
        raise ValueError("block_fp8_gemm: xq and wq need contiguous rows")
    w_scale_inv = w_scale_inv.float()
    out = torch.empty(rows, cols, dtype=out_dtype, device=xq.device)
    if rows == 0:
        return out
    tiles = tiles or gemm_tiles(rows)
    k_tiles = -(-depth // block_k)
    if splits is None:
        splits, per_split = split_k_plan(tiles, cols, k_tiles, num_sms(xq.device))
    else:
        splits, per_split = fixed_split(k_tiles, splits)
    target = out if splits == 1 else torch.empty(splits, rows, cols, device=xq.device)
    n_tiles, m_tiles = triton.cdiv(cols, tiles.block_n), triton.cdiv(rows, tiles.block_m)
    strides = (
        xq.stride(0), x_scale.stride(0), x_scale.stride(1), wq.stride(0),
        w_scale_inv.stride(0), w_scale_inv.stride(1),
        target.stride(-2), target.stride(0) if splits > 1 else 0,
    )  # fmt: skip
    bias_arg = bias if bias is not None else w_scale_inv
    launch = dict(
        W_BLOCK_N=bn, HAS_BIAS=bias is not None and splits == 1, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_launch_kwargs(xq.device, n_tiles * m_tiles * splits),
    )  # fmt: skip
    if tiles.swap_ab:
        _block_fp8_gemm_swap_kernel[(n_tiles, m_tiles, splits)](
            xq, x_scale, wq, w_scale_inv, target, bias_arg, rows, cols, depth, per_split,
            *strides, **launch,
        )  # fmt: skip
    else:
        _block_fp8_gemm_kernel[(n_tiles * m_tiles, splits)](
            xq, x_scale, wq, w_scale_inv, target, bias_arg, rows, cols, depth, per_split,
            *strides, GROUP_M=tiles.group_m, **launch,
        )  # fmt: skip
    if splits > 1:
        width = min(1024, triton.next_power_of_2(cols))
        sum_grid = (rows, triton.cdiv(cols, width))
        _split_k_sum_kernel[sum_grid](
            target, out, bias if bias is not None else target, rows, cols, splits,
            target.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK=width,
            num_warps=4, **pdl_launch_kwargs(xq.device, sum_grid[0] * sum_grid[1]),
        )  # fmt: skip
    return out
