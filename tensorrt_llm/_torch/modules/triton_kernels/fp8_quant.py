"""Per-token dynamic FP8 (e4m3) quantisation in one kernel: row amax, scale, cast, store.

The torch path takes six launches (abs, amax, cast, divide, clamp, cast) per linear layer; at
decode batch sizes those launches cost more than the bandwidth FP8 weights save.
`rows_out` lets the caller get a row-padded output (padding rows zero, scale 1) for GEMMs that
want a multiple of 16 rows.
"""

from __future__ import annotations

import torch

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton

FP8_MAX = 448.0  # largest finite e4m3 value (the FP8 linear layers and KV cache share it)
_MIN_SCALE = 1e-12


@triton_jit
def e4m3_row_scale(amax, valid):
    # The scale that maps a row's amax to 448 (e4m3's largest finite value, FP8_MAX); rows
    # that are not `valid` (padding) get 1. Shared by every kernel that quantises rows, so
    # fused and separate quantisation give the same bytes.
    return tl.where(valid, tl.maximum(amax / 448.0, 1e-12), 1.0)


@triton_jit
def e4m3_saturate(x):
    return tl.minimum(tl.maximum(x, -448.0), 448.0)


@triton_jit(do_not_specialize=("n_rows",))
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    n_rows,
    cols,
    x_stride,
    q_stride,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    # grid: (rows_out,) — one program quantises one row (cols <= BLOCK). Programs past the
    # input's `n_rows` write the padding rows (zeros, scale 1), so padding needs no fill kernels.
    row = tl.program_id(0).to(tl.int64)
    valid = row < n_rows
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask & valid, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = e4m3_row_scale(amax, valid)
    q = e4m3_saturate(x / scale)
    tl.store(q_ptr + row * q_stride + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_(min=_MIN_SCALE)
    xq = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, scale


def quantize_rows(
    x: torch.Tensor, rows_out: int | None = None, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [M, K]` -> (e4m3 `[rows_out or M, K]`, fp32 scales `[rows_out or M, 1]`)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be [M, K], got {tuple(x.shape)}")
    rows, cols = x.shape
    total = rows if rows_out is None else rows_out
    if total < rows:
        raise ValueError(f"quantize_rows: rows_out {total} < rows {rows}")
    if not use_triton("fp8_quant", x.device, backend) or cols > 16384:
        xq, scale = quantize_rows_torch(x)
        if total > rows:
            xq = torch.cat([xq, xq.new_zeros(total - rows, cols)])
            scale = torch.cat([scale, scale.new_ones(total - rows, 1)])
        return xq, scale
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty(total, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(total, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(cols)
    _quant_rows_kernel[(total,)](
        x,
        xq,
        scale,
        rows,
        cols,
        x.stride(0),
        xq.stride(0),
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        **pdl_launch_kwargs(x.device, total),
    )
    return xq, scale
