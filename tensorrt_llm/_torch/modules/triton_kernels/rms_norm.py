"""Fused residual add + RMSNorm over the last dim, one launch per call.

Replaces the chain of small torch kernels (add, cast, pow, mean, rsqrt, mul, cast, mul) that a
decode step runs for every norm. Works on `[..., D]` rows, including the per-head q/k norm of
Qwen3 (`[T, H, D]` with a `[D]` weight, which may be a strided view of the fused qkv output).

Rounding follows the torch modules exactly, so the only differences are reduction order and
rsqrt precision:
- plain (`RMSNorm`): `weight * (x32 * rstd).to(dtype)`, i.e. rounded once before the weight
  multiply and once after it;
- zero-centered (`ZeroCenteredRMSNorm`, Qwen3.5): `(x32 * rstd * (1 + weight32)).to(dtype)`.
With a residual, the sum `x + residual` is rounded to the input dtype first (it is returned as
the new residual) and the norm reads that rounded sum.
"""

from __future__ import annotations

import torch

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton
from .fp8_block import (
    group_quant_values,
    group_scales,
    pad_group_quant,
    per_token_group_quant_fp8_torch,
)
from .fp8_quant import e4m3_row_scale, e4m3_saturate, quantize_rows
from .fp8_scale import scale_outer_torch

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One program holds a whole row in registers; wider rows take the torch path.
_MAX_BLOCK_D = 32768
# Small rows (per-head norms) are packed several per program up to about this many elements.
_ROW_PACK_ELEMS = 4096


@triton_jit(do_not_specialize=("n_rows", "rows_out"))
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    q_ptr,
    scale_ptr,
    x_row_scale_ptr,
    x_col_scale_ptr,
    n_rows,
    rows_out,
    num_groups,
    scale_stride,
    scale_gstride,
    heads,
    x_stride_t,
    x_stride_h,
    r_stride_t,
    r_stride_h,
    dim,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RES: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    QUANT: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
    X_SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    # Rows are (token, head) pairs of a [T, heads, dim] view; outputs are contiguous.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    tok = rows // heads
    head = rows % heads
    x_offs = (tok * x_stride_t + head * x_stride_h)[:, None] + cols[None, :]
    out_offs = rows[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if X_SCALED:
        # x is an unscaled FP8 GEMM output (one head per row): apply its row x column scales
        # and round as `scale_outer_` would have stored them.
        a = tl.load(x_row_scale_ptr + rows, mask=rows < n_rows, other=0.0)
        b = tl.load(x_col_scale_ptr + cols, mask=col_mask, other=0.0)
        x = (x.to(tl.float32) * (a[:, None] * b[None, :])).to(x_ptr.dtype.element_ty)
    if HAS_RES:
        r_offs = (tok * r_stride_t + head * r_stride_h)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
        # NOTE: rounded to the input dtype before the norm reads it, as `x + residual` in torch.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_res_ptr + out_offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / dim + eps)
    normed = x32 * rstd[:, None]
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = normed * (1.0 + w)[None, :]
    else:
        y = normed.to(x_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    if QUANT:
        # e4m3 rows for an FP8 linear instead of the 16-bit output: the rounded output
        # quantised as `quantize_rows` would quantise it (per 1 x QUANT_GROUP group as
        # `per_token_group_quant_fp8` when QUANT_GROUP > 0), padding rows (up to rows_out)
        # written as zeros with scale 1.
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        valid = rows < n_rows
        q_mask = (rows < rows_out)[:, None] & col_mask[None, :]
        if QUANT_GROUP > 0:
            y3 = tl.reshape(y, [BLOCK_ROWS, BLOCK_D // QUANT_GROUP, QUANT_GROUP])
            g_scale = e4m3_row_scale(tl.max(tl.abs(y3), axis=2), valid[:, None])
            q = tl.reshape(group_quant_values(y3, g_scale), [BLOCK_ROWS, BLOCK_D])
            groups = tl.arange(0, BLOCK_D // QUANT_GROUP)
            g_offs = rows[:, None] * scale_stride + groups[None, :] * scale_gstride
            g_mask = (rows < rows_out)[:, None] & (groups < num_groups)[None, :]
            tl.store(scale_ptr + g_offs, g_scale, mask=g_mask)
        else:
            scale = e4m3_row_scale(tl.max(tl.abs(y), axis=1), valid)
            q = e4m3_saturate(y / scale[:, None])
            tl.store(scale_ptr + rows, scale, mask=rows < rows_out)
        # Padding rows hold 0 * w, which is -0 where w < 0; write +0 so the bytes match
        # `quantize_rows` (the GEMM ignores them either way).
        q = tl.where(valid[:, None], q, 0.0)
        tl.store(q_ptr + out_offs, q.to(q_ptr.dtype.element_ty), mask=q_mask)
    else:
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference; bit-for-bit the math of `RMSNorm` / `ZeroCenteredRMSNorm`."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if zero_centered:
        out = (x32 * (1.0 + weight.float())).to(x.dtype)
    else:
        # Cast back before the weight multiply, matching the HF reference rounding in bf16.
        out = weight * x32.to(x.dtype)
    return out if residual is None else (out, x)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """`[..., D]` -> a `[T, H, D]` view (copy only when no such view exists)."""
    if x.dim() == 3 and x.stride(2) == 1:
        return x
    if x.dim() == 2 and x.stride(1) == 1:
        return x[:, None, :]
    flat = x.reshape(-1, x.shape[-1])
    return (flat if flat.stride(1) == 1 else flat.contiguous())[:, None, :]


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x must be [..., D] with D > 0, got {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm: weight must be [{x.shape[-1]}] for x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
        )


def kernel_unsupported_reason(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> str:
    """Why the kernel cannot take these inputs ("" when it can)."""
    if x.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not one of {_SUPPORTED_DTYPES}"
    # Mixed dtypes keep torch's type promotion, which the kernel does not model.
    if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return "x, weight and residual must share one dtype"
    if x.shape[-1] > _MAX_BLOCK_D:
        return f"last dim {x.shape[-1]} exceeds {_MAX_BLOCK_D}"
    if weight.device != x.device or (residual is not None and residual.device != x.device):
        return "x, weight and residual must be on one device"
    return ""


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centered: bool = False,
    backend: str = "auto",
    x_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x: [..., D]` over its last dim with `weight: [D]`; float32 statistics.

    Returns `out` (x's shape and dtype), or `(out, x + residual)` when `residual` is given.
    `zero_centered` scales by `1 + weight` (Qwen3.5). Inputs the kernel does not cover (mixed
    dtypes, D > 32768) take the torch path under "auto" and raise under "triton".
    `x_scales = (row_scale, col_scale)`: `x: [M, D]` is an unscaled FP8 GEMM output, scaled
    on load by `row_scale[m] * col_scale[d]` (fp32, `[>= M]` and `[D]`) as `scale_outer_` would.
    """
    _check_args(x, weight, residual)
    _check_x_scales(x, x_scales)
    if not use_triton("rms_norm", x.device, backend):
        return rms_norm_torch(_scaled(x, x_scales), weight, eps, residual, zero_centered)
    reason = kernel_unsupported_reason(x, weight, residual)
    if reason:
        if backend == "triton":
            raise ValueError(f"rms_norm: backend='triton' cannot run this input: {reason}")
        return rms_norm_torch(_scaled(x, x_scales), weight, eps, residual, zero_centered)
    x3 = _as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = None if residual is None else torch.empty_like(out)
    _launch(x3, residual, weight, eps, zero_centered, out, new_res, None, None, x_scales)
    return out if new_res is None else (out, new_res)


def _check_x_scales(x: torch.Tensor, x_scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    if x_scales is None:
        return
    row_scale, col_scale = x_scales
    if x.dim() != 2 or row_scale.numel() < x.shape[0] or col_scale.numel() != x.shape[1]:
        raise ValueError(
            f"rms_norm: x_scales for x {tuple(x.shape)} must be [>= {x.shape[0]}] row and "
            f"[{x.shape[-1]}] column scales of a 2-D x, got {row_scale.numel()} and "
            f"{col_scale.numel()}"
        )


def _scaled(x: torch.Tensor, x_scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The torch path's view of a scaled-on-load input: `scale_outer_`'s result."""
    if x_scales is None:
        return x
    row_scale, col_scale = x_scales
    return scale_outer_torch(x.clone(), row_scale.reshape(-1)[: x.shape[0]], col_scale, None)


def _launch(
    x3: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    out: torch.Tensor,
    new_res: torch.Tensor | None,
    q: torch.Tensor | None,
    scale: torch.Tensor | None,
    x_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    group: int = 0,
) -> None:
    """One kernel launch over the `[T, heads, D]` view `x3`: the 16-bit output into `out`, or
    with `q`/`scale` the e4m3 rows (`q.shape[0]` rows, padding included) and their scales
    (per row, or per 1 x `group` columns into a `[rows, groups]` tensor of any strides).
    `x_scales` (row, column) scale an unscaled FP8 GEMM output on load."""
    res3 = None if residual is None else _as_rows(residual)
    num_tokens, heads, dim = x3.shape
    n_rows = num_tokens * heads
    rows_out = n_rows if q is None else q.shape[0]
    if rows_out == 0:
        return
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    block_d = triton_block_d(dim)
    # Depends on the row width only, never the row count: one compiled variant serves every
    # batch (masked rows of a short batch cost next to nothing).
    block_rows = max(1, _ROW_PACK_ELEMS // block_d)
    num_warps = max(1, min(16, block_rows * block_d // 512))
    programs = triton.cdiv(rows_out, block_rows)
    dummy = x3  # Stands in for absent pointers; never dereferenced (constexpr-gated).
    _rms_norm_kernel[(programs,)](
        x3, dummy if res3 is None else res3, w, out, out if new_res is None else new_res,
        dummy if q is None else q, dummy if scale is None else scale,
        dummy if x_scales is None else x_scales[0], dummy if x_scales is None else x_scales[1],
        n_rows, rows_out, 0 if scale is None else scale.shape[-1],
        0 if scale is None else scale.stride(0), 0 if scale is None else scale.stride(-1),
        heads, x3.stride(0), x3.stride(1),
        0 if res3 is None else res3.stride(0), 0 if res3 is None else res3.stride(1),
        dim, float(eps),
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, HAS_RES=res3 is not None,
        ZERO_CENTERED=zero_centered, QUANT=q is not None, QUANT_GROUP=group,
        X_SCALED=x_scales is not None,
        num_warps=num_warps,
        **pdl_launch_kwargs(x3.device, programs),
    )  # fmt: skip


def rms_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centered: bool = False,
    rows_out: int | None = None,
    backend: str = "auto",
    x_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    group: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of `x: [M, D]` straight into per-row e4m3 for an FP8 linear, in one launch.

    With `group` (a power of two dividing the kernel's row block), per 1 x `group` column
    groups for a block-FP8 linear instead: the scales are `[rows_out or M, ceil(D/group)]`,
    M-major, with `per_token_group_quant_fp8`'s bytes.

    Returns (e4m3 `[rows_out or M, D]`, fp32 scales `[rows_out or M, 1]`, the new residual
    `x + residual` or None): the numbers of `quantize_rows(rms_norm(x, ...), rows_out)`
    without the 16-bit round trip through memory (rows past M: zeros with scale 1).
    `x_scales` as in `rms_norm`.
    """
    _check_args(x, weight, residual)
    if x.dim() != 2:
        raise ValueError(f"rms_norm_quant_fp8: x must be [M, D], got {tuple(x.shape)}")
    _check_x_scales(x, x_scales)
    rows = x.shape[0] if rows_out is None else rows_out
    if rows < x.shape[0]:
        raise ValueError(f"rms_norm_quant_fp8: rows_out {rows} < rows {x.shape[0]}")
    use_kernel = use_triton("rms_norm", x.device, backend)
    if use_kernel:
        reason = kernel_unsupported_reason(x, weight, residual)
        if reason and backend == "triton":
            raise ValueError(f"rms_norm_quant_fp8: backend='triton' cannot run this: {reason}")
        use_kernel = not reason
    if group and (group & (group - 1) or group > triton_block_d(x.shape[1])):
        raise ValueError(f"rms_norm_quant_fp8: group {group} must be a power of two <= the "
                         f"row block {triton_block_d(x.shape[1])}")  # fmt: skip
    if not use_kernel:
        normed = rms_norm_torch(_scaled(x, x_scales), weight, eps, residual, zero_centered)
        out, new_res = normed if residual is not None else (normed, None)
        if group:
            q, scale = per_token_group_quant_fp8_torch(out, group)
            return (*pad_group_quant(q, scale, rows, True), new_res)
        q, scale = quantize_rows(out, rows_out=rows, backend="torch")
        return q, scale, new_res
    new_res = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q = torch.empty(rows, x.shape[1], dtype=torch.float8_e4m3fn, device=x.device)
    if group:
        scale = group_scales(rows, -(-x.shape[1] // group), x.device, True)
    else:
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _launch(
        _as_rows(x), residual, weight, eps, zero_centered, x, new_res, q, scale, x_scales, group
    )
    return q, scale, new_res


def triton_block_d(dim: int) -> int:
    """The kernel's row block for rows of `dim` elements."""
    return 1 << max(0, dim - 1).bit_length()
