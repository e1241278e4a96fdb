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

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton_jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    x_stride,
    out_stride,
    row_scale_ptr,
    col_scale_ptr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    # grid: (T, column blocks of the I outputs)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        a = tl.load(row_scale_ptr + row)
        gate_s = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        up_s = tl.load(col_scale_ptr + inter + cols, mask=mask, other=0.0)
        gate = (gate * (a * gate_s)).to(x_ptr.dtype.element_ty).to(tl.float32)
        up = (up * (a * up_s)).to(x_ptr.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


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
        SCALED=scaled,
        BLOCK=block,
        num_warps=max(1, min(4, block // 256)),
        **pdl_launch_kwargs(out.device, grid[0] * grid[1]),
    )
    return out
