"""Outer-product rescale of an FP8 GEMM's output, in place: `out[m, n] *= a[m] * b[n] (+ bias[n])`.

cuBLASLt's row-wise-scaled FP8 GEMMs reach about half the weight bandwidth of its tensor-wise
(scalar-scale) ones at decode row counts (Qwen3-VL-8B on the H200: qkv 13.6 vs 7.9 us, down
32.6 vs 16.4 us; benchmarks/results/fp8_gemm_h200.md). `fp8_linear` therefore runs the
tensor-wise GEMM with unit scales and applies the per-token and per-channel scales here. The
product `a[m] * b[n]` is what the row-wise GEMM applies too, so only the rounding differs: the
16-bit GEMM output is rounded once more after scaling.
"""

from __future__ import annotations

import torch

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton

_BLOCK_N = 1024


@triton_jit(do_not_specialize=("rows",))
def _scale_outer_kernel(
    out_ptr, a_ptr, b_ptr, bias_ptr, rows, cols, out_stride, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid: (rows, column blocks)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < cols
    ptrs = out_ptr + row * out_stride + offs
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    col_scale = tl.load(b_ptr + offs, mask=mask, other=0.0)
    y = y * (tl.load(a_ptr + row) * col_scale)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def scale_outer_torch(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    y = out.float() * (a.view(-1, 1) * b.view(1, -1))
    if bias is not None:
        y += bias.float()
    return out.copy_(y)


def scale_outer_(
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """In place on `out: [M, N]` (unit stride along N): `out * a[:, None] * b[None, :] + bias`.

    `a` holds M fp32 row scales (any shape with M elements, e.g. `[M, 1]`), `b` N fp32 column
    scales; `bias` is an optional `[N]`. Returns `out`.
    """
    if out.dim() != 2 or out.stride(1) != 1:
        raise ValueError(f"scale_outer_: out must be [M, N] with unit column stride, got "
                         f"shape {tuple(out.shape)} stride {out.stride()}")  # fmt: skip
    rows, cols = out.shape
    if a.numel() < rows or b.numel() != cols or (bias is not None and bias.numel() != cols):
        raise ValueError(
            f"scale_outer_: out {tuple(out.shape)} needs {rows} row scales and {cols} column "
            f"scales/bias, got {a.numel()}, {b.numel()}"
            + ("" if bias is None else f", {bias.numel()}")
        )
    if not use_triton("fp8_scale", out.device, backend):
        return scale_outer_torch(out, a.reshape(-1)[:rows], b, bias)
    if rows == 0:
        return out
    a, b = a.reshape(-1), b.reshape(-1)  # views for the contiguous scale vectors callers pass
    block = min(_BLOCK_N, triton.next_power_of_2(cols))
    _scale_outer_kernel[(rows, triton.cdiv(cols, block))](
        out,
        a,
        b,
        bias if bias is not None else b,
        rows,
        cols,
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block,
        num_warps=max(1, min(4, block // 256)),
        **pdl_launch_kwargs(out.device, rows * triton.cdiv(cols, block)),
    )
    return out
