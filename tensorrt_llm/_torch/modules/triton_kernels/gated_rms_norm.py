"""Gated RMSNorm of Gated DeltaNet's output, `weight * RMSNorm(o) * silu(z)`, in one launch.

Replaces the torch chain of `RMSNormGated` (cast, pow, mean, add, rsqrt, mul, cast, mul, silu,
mul, cast: ~11 kernels per layer and decode step). Rows are (token, value head) pairs of
`o: [T, H, D]` and of the gate `z`, which may be a strided view of the fused `in_proj_qkvz`
output; the result is contiguous `[T, H * D]`, ready for `out_proj`.

Rounding follows `RMSNormGated.forward` step for step, so only the reduction order and the
rsqrt / sigmoid precision differ: the normalised value is rounded to o's dtype before the weight
multiply (as HF's reference), the weighted value to `promote(weight, o)` (16-bit when both are),
and the gated product, formed in float32, to o's dtype.
"""

from __future__ import annotations

import torch

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton

# Per-head rows are short (128): pack a few per program.
_ROW_PACK_ELEMS = 2048


@triton_jit(do_not_specialize=("n_rows",))
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,
    n_rows, heads, dim, stride_xt, stride_xh, stride_zt, stride_zh, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_Y: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    tok, head = rows // heads, rows % heads
    x = tl.load(
        x_ptr + (tok * stride_xt + head * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0
    )
    z = tl.load(
        z_ptr + (tok * stride_zt + head * stride_zh)[:, None] + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, 1) / dim + eps)
    dtype = x_ptr.dtype.element_ty
    normed = (x32 * rstd[:, None]).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = w[None, :] * normed
    if ROUND_Y:
        y = y.to(dtype).to(tl.float32)
    out = y * (z * tl.sigmoid(z))
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], out.to(dtype), mask=mask)


def rms_norm_gated_torch(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The reference (`RMSNormGated.forward`): `[..., D]` rows, output in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    # The weight multiplies the input-dtype value, as HF's reference rounds in bf16.
    y = weight * x32.to(x.dtype)
    return (y * torch.nn.functional.silu(gate.float())).to(x.dtype)


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto"
) -> torch.Tensor:
    """`x, gate: [T, H, D]` (each with a contiguous last dim; any token / head strides),
    `weight: [D]`. Returns `[T, H * D]` contiguous in x's dtype."""
    if x.dim() != 3 or gate.shape != x.shape:
        raise ValueError(f"x and gate must be [T, H, D] and equal, got {x.shape}, {gate.shape}")
    num_tokens, heads, dim = x.shape
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}], got {tuple(weight.shape)}")
    if not use_triton("rms_norm_gated", x.device, backend):
        return rms_norm_gated_torch(x, gate, weight, eps).reshape(num_tokens, heads * dim)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    out = torch.empty(num_tokens, heads * dim, dtype=x.dtype, device=x.device)
    n_rows = num_tokens * heads
    if n_rows == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    block_rows = max(1, min(_ROW_PACK_ELEMS // block_d, triton.next_power_of_2(n_rows)))
    grid = (triton.cdiv(n_rows, block_rows),)
    round_y = torch.promote_types(weight.dtype, x.dtype) != torch.float32
    _gated_rms_norm_kernel[grid](
        x, gate, weight, out,
        n_rows, heads, dim, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), eps,
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, ROUND_Y=round_y,
        **pdl_launch_kwargs(x.device, grid[0]),
    )  # fmt: skip
    return out
