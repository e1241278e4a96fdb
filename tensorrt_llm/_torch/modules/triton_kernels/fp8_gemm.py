"""FP8-weight GEMM for decode-sized batches: `out = (a @ dequant(w)^T)` with few rows of `a`.

At decode batch sizes a linear layer only streams its weights; cuBLASLt's row-wise-scaled FP8
kernels reach about half of HBM bandwidth there (benchmarks/bench_gemm.py). This kernel tiles
only the output columns and, when the columns alone give too few programs, splits K, so every
SM streams weight tiles.

Two operand forms (constexpr `A_FP8`):
- W8A8: `a` is e4m3 with one scale per row (from `quantize_rows`), products in fp8;
- W8A16: `a` stays in 16 bits and each weight tile is converted after loading, which skips the
  activation quantisation kernel.
Scales are applied to each split's fp32 partial (they are linear), so with one split the kernel
writes the output directly and otherwise a small kernel sums the splits in a fixed order
(deterministic, unlike atomics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import tl, triton, triton_jit, use_triton

# Programs worth launching: ~2 waves of an H200's 132 SMs.
_TARGET_PROGRAMS = 264
_MAX_SPLITS = 16


@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int


@triton_jit(do_not_specialize=("m", "split_len"))
def _fp8_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    part_ptr,
    m,
    n,
    k,
    split_len,
    stride_am,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_FP8: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # grid: (column tiles, row tiles, K splits). K and split_len are multiples of BLOCK_K.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < m
    n_ok = offs_n < n
    k_start = split * split_len
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The last split may be shorter than split_len.
    for _ in range(0, tl.minimum(split_len, k - k_start), BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        if A_FP8:
            acc = tl.dot(a, tl.trans(w), acc)
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if A_FP8:
        acc = acc * tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        part = part_ptr + (split * m + offs_m)[:, None].to(tl.int64) * n + offs_n[None, :]
        tl.store(part, acc, mask=mask)
    else:
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton_jit(do_not_specialize=("numel", "num_splits"))
def _sum_splits_kernel(part_ptr, out_ptr, numel, num_splits, BLOCK: tl.constexpr):
    # part: [num_splits, m * n] fp32 -> out: [m * n] (contiguous), summed in split order.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def default_tiles(rows: int, k: int, a_fp8: bool, on_gpu: bool) -> GemmTiles:
    """Tiles for `rows` rows of `a`; the smallest legal ones under the interpreter."""
    block_m = max(16, triton.next_power_of_2(rows))
    if not on_gpu:
        return GemmTiles(block_m, 16, 16 if k % 32 else 32, 1, 4)
    block_k = 256 if a_fp8 else 128
    while k % block_k:
        block_k //= 2
    return GemmTiles(block_m, 64, block_k, 4, 4)


def choose_splits(m_tiles: int, n_tiles: int, k: int, block_k: int) -> int:
    """K splits so that (row tiles x column tiles x splits) fills the GPU, each split at least
    four K tiles long."""
    wanted = triton.cdiv(_TARGET_PROGRAMS, m_tiles * n_tiles)
    by_length = max(1, k // (4 * block_k))
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def supports(rows: int, k: int) -> bool:
    """Shapes the kernel takes: K a multiple of 16 and few enough rows to be bandwidth bound."""
    return k % 16 == 0 and 0 < rows <= 128


def fp8_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    tiles: GemmTiles | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`a: [M, K]` (e4m3 with `a_scale: [M, 1]`, or 16-bit with `a_scale=None`), `w: [N, K]`
    e4m3 with `w_scale: [N]` -> `[M, N]` in `out_dtype`. `tiles` / `num_splits` override
    the defaults (benchmarks)."""
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or w.dtype != torch.float8_e4m3fn or w_scale.numel() != n:
        raise ValueError(
            f"fp8_gemm: bad weight {tuple(w.shape)} {w.dtype} for a of {tuple(a.shape)}"
        )
    a_fp8 = a.dtype == torch.float8_e4m3fn
    if a_fp8 != (a_scale is not None):
        raise ValueError("fp8_gemm: a_scale is required exactly when a is e4m3")
    if not supports(m, k):
        raise ValueError(f"fp8_gemm: unsupported shape M={m}, K={k}")
    if not use_triton("fp8_gemm", a.device, "triton"):
        raise RuntimeError("fp8_gemm needs CUDA or TRITON_INTERPRET=1")
    if a.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("fp8_gemm: a and w must be contiguous along K")
    tiles = tiles or default_tiles(m, k, a_fp8, a.is_cuda)
    if k % tiles.block_k:
        raise ValueError(f"fp8_gemm: K={k} is not a multiple of block_k={tiles.block_k}")
    m_tiles, n_tiles = triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n)
    k_tiles = k // tiles.block_k
    splits = num_splits or choose_splits(m_tiles, n_tiles, k, tiles.block_k)
    # Whole K tiles per split, and no empty split.
    split_len = triton.cdiv(k_tiles, splits) * tiles.block_k
    splits = triton.cdiv(k, split_len)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    part = out
    if splits > 1:
        part = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    _fp8_gemm_kernel[(n_tiles, m_tiles, splits)](
        a,
        a_scale if a_fp8 else w_scale,  # placeholder pointer when unused
        w,
        w_scale,
        out,
        part,
        m,
        n,
        k,
        split_len,
        a.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        A_FP8=a_fp8,
        SPLIT=splits > 1,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, splits, BLOCK=block)
    return out
