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

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One program holds a whole row in registers; wider rows take the torch path.
_MAX_BLOCK_D = 32768
# Small rows (per-head norms) are packed several per program up to about this many elements.
_ROW_PACK_ELEMS = 4096


@triton_jit(do_not_specialize=("n_rows",))
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    n_rows,
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x: [..., D]` over its last dim with `weight: [D]`; float32 statistics.

    Returns `out` (x's shape and dtype), or `(out, x + residual)` when `residual` is given.
    `zero_centered` scales by `1 + weight` (Qwen3.5). Inputs the kernel does not cover (mixed
    dtypes, D > 32768) take the torch path under "auto" and raise under "triton".
    """
    _check_args(x, weight, residual)
    if not use_triton("rms_norm", x.device, backend):
        return rms_norm_torch(x, weight, eps, residual, zero_centered)
    reason = kernel_unsupported_reason(x, weight, residual)
    if reason:
        if backend == "triton":
            raise ValueError(f"rms_norm: backend='triton' cannot run this input: {reason}")
        return rms_norm_torch(x, weight, eps, residual, zero_centered)
    x3 = _as_rows(x)
    res3 = None if residual is None else _as_rows(residual)
    num_tokens, heads, dim = x3.shape
    n_rows = num_tokens * heads
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = None if residual is None else torch.empty_like(out)
    if n_rows == 0:
        return out if new_res is None else (out, new_res)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    block_d = triton.next_power_of_2(dim)
    # Depends on the row width only, never the row count: one compiled variant serves every
    # batch (masked rows of a short batch cost next to nothing).
    block_rows = max(1, _ROW_PACK_ELEMS // block_d)
    num_warps = max(1, min(16, block_rows * block_d // 512))
    dummy = x3  # Stands in for absent residual pointers; never dereferenced (constexpr-gated).
    _rms_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
        x3, dummy if res3 is None else res3, w, out, out if new_res is None else new_res,
        n_rows, heads, x3.stride(0), x3.stride(1),
        0 if res3 is None else res3.stride(0), 0 if res3 is None else res3.stride(1),
        dim, float(eps),
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, HAS_RES=res3 is not None,
        ZERO_CENTERED=zero_centered, num_warps=num_warps,
        **pdl_launch_kwargs(x.device, triton.cdiv(n_rows, block_rows)),
    )  # fmt: skip
    return out if new_res is None else (out, new_res)
