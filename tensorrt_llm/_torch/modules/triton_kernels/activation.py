"""Fused SwiGLU activation: `silu(gate) * up` from one `[..., 2I]` gate_up tensor.

The layout is `GatedMLP.gate_up_proj`'s: the first `I` channels are the gate, the last `I` the
up projection. One kernel replaces torch's chunk + silu + mul (two launches and a temporary).
Rounding follows torch: silu is computed in float32 and rounded to the input dtype, then the
product is computed in float32 and rounded again.

With `row_scale`/`col_scale` the input is an unscaled FP8 GEMM output (`fp8_linear`'s
tensor-wise path) and the kernel applies the scales on load, rounded to the input dtype as
`scale_outer_` would store them, which saves that kernel's launch and its pass over gate_up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton
from .fp8_block import (
    FP8_DTYPE,
    group_quant_values,
    group_scales,
    pad_group_quant,
    per_token_group_quant_fp8_torch,
)
from .fp8_quant import e4m3_row_scale

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton_jit(do_not_specialize=("rows",))
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    x_stride,
    out_stride,
    row_scale_ptr,
    col_scale_ptr,
    scale_ptr,
    rows,
    scale_stride,
    scale_gstride,
    SCALED: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    # grid: (T, column blocks of the I outputs); with QUANT_GROUP, (rows_out, ...) where rows
    # past T are padding (zeros, scale 1).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    load_mask = mask & (row < rows)
    gate = tl.load(x_ptr + row * x_stride + cols, mask=load_mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=load_mask, other=0.0)
    up = up.to(tl.float32)
    if SCALED:
        a = tl.load(row_scale_ptr + row)
        gate_s = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        up_s = tl.load(col_scale_ptr + inter + cols, mask=mask, other=0.0)
        gate = (gate * (a * gate_s)).to(x_ptr.dtype.element_ty).to(tl.float32)
        up = (up * (a * up_s)).to(x_ptr.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = act * up
    if QUANT_GROUP > 0:
        # e4m3 for a block-FP8 down projection: the rounded product quantised per 1 x
        # QUANT_GROUP group, as `per_token_group_quant_fp8` would.
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        y2 = tl.reshape(y, [BLOCK // QUANT_GROUP, QUANT_GROUP])
        g_scale = e4m3_row_scale(tl.max(tl.abs(y2), axis=1), row < rows)
        q = tl.reshape(group_quant_values(y2, g_scale), [BLOCK])
        groups = tl.program_id(1) * (BLOCK // QUANT_GROUP) + tl.arange(0, BLOCK // QUANT_GROUP)
        g_mask = groups * QUANT_GROUP < inter
        tl.store(scale_ptr + row * scale_stride + groups * scale_gstride, g_scale, mask=g_mask)
        tl.store(out_ptr + row * out_stride + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch reference, exactly `GatedMLP`'s former `chunk` + `silu` + `mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _apply_scales(
    gate_up: torch.Tensor, row_scale: torch.Tensor | None, col_scale: torch.Tensor | None
) -> torch.Tensor:
    if row_scale is None:
        return gate_up
    rows = gate_up.reshape(-1, gate_up.shape[-1]).shape[0]
    scaled = gate_up.float() * row_scale.reshape(-1)[:rows].view(*gate_up.shape[:-1], 1)
    return (scaled * col_scale.reshape(-1)).to(gate_up.dtype)


def silu_and_mul(
    gate_up: torch.Tensor,
    backend: str = "auto",
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`silu(gate_up[..., :I]) * gate_up[..., I:]` for `gate_up: [..., 2I]` -> `[..., I]`.

    `row_scale` (fp32, one per token; extra trailing entries are ignored) and `col_scale`
    (fp32 `[2I]`), given together, first scale `gate_up[t, c]` by `row_scale[t] * col_scale[c]`.
    """
    if gate_up.dim() < 1 or gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"silu_and_mul: gate_up must be [..., 2I] with I > 0, got {tuple(gate_up.shape)}"
        )
    if (row_scale is None) != (col_scale is None):
        raise ValueError("silu_and_mul: row_scale and col_scale go together")
    num_rows = gate_up.numel() // gate_up.shape[-1]
    if row_scale is not None and (
        row_scale.numel() < num_rows or col_scale.numel() != gate_up.shape[-1]
    ):
        raise ValueError(
            f"silu_and_mul: gate_up {tuple(gate_up.shape)} needs {num_rows} row scales and "
            f"{gate_up.shape[-1]} column scales, got {row_scale.numel()} and {col_scale.numel()}"
        )
    if not use_triton("silu_and_mul", gate_up.device, backend):
        return silu_and_mul_torch(_apply_scales(gate_up, row_scale, col_scale))
    if gate_up.dtype not in _SUPPORTED_DTYPES:
        if backend == "triton":
            raise ValueError(f"silu_and_mul: dtype {gate_up.dtype} not in {_SUPPORTED_DTYPES}")
        return silu_and_mul_torch(_apply_scales(gate_up, row_scale, col_scale))
    inter = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    num_tokens = x2.shape[0]
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    scaled = row_scale is not None
    _silu_and_mul_kernel[grid](
        x2,
        out,
        inter,
        x2.stride(0),
        inter,
        row_scale.reshape(-1) if scaled else x2,
        col_scale.reshape(-1) if scaled else x2,
        x2,
        num_tokens,
        0,
        0,
        SCALED=scaled,
        QUANT_GROUP=0,
        BLOCK=block,
        num_warps=max(1, min(4, block // 256)),
        **pdl_launch_kwargs(out.device, grid[0] * grid[1]),
    )
    return out


def silu_and_mul_group_quant(
    gate_up: torch.Tensor, group: int, rows_out: int | None = None, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul(gate_up)` for `gate_up: [T, 2I]` quantised per 1 x `group` columns in
    the same launch, for a block-FP8 down projection: (e4m3 `[rows_out or T, I]`, M-major fp32
    scales `[rows_out or T, ceil(I/group)]`), the bytes of `per_token_group_quant_fp8` on the
    16-bit product, padding rows zeros with scale 1."""
    if gate_up.dim() != 2 or gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"silu_and_mul_group_quant: gate_up must be [T, 2I], got {tuple(gate_up.shape)}"
        )
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    total = rows if rows_out is None else rows_out
    if total < rows:
        raise ValueError(f"silu_and_mul_group_quant: rows_out {total} < rows {rows}")
    block = min(_BLOCK, triton.next_power_of_2(inter)) if triton is not None else 0
    kernel = use_triton("silu_and_mul", gate_up.device, backend)
    kernel = kernel and gate_up.dtype in _SUPPORTED_DTYPES and block % group == 0
    if not kernel:
        if backend == "triton":
            raise ValueError(
                f"silu_and_mul_group_quant: the kernel needs a 16/32-bit gate_up and a group "
                f"dividing {block}, got {gate_up.dtype} and {group}"
            )
        q, scale = per_token_group_quant_fp8_torch(silu_and_mul_torch(gate_up), group)
        return pad_group_quant(q, scale, total, True)
    x2 = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    q = torch.empty(total, inter, dtype=FP8_DTYPE, device=gate_up.device)
    scale = group_scales(total, -(-inter // group), gate_up.device, True)
    if total == 0:
        return q, scale
    grid = (total, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x2, q, inter, x2.stride(0), inter, x2, x2, scale, rows, scale.stride(0),
        scale.stride(1), SCALED=False, QUANT_GROUP=group, BLOCK=block,
        num_warps=max(1, min(4, block // 256)),
        **pdl_launch_kwargs(q.device, grid[0] * grid[1]),
    )  # fmt: skip
    return q, scale
