"""The causal conv's state after the first tokens of a step, into its pool row (MTP rollback).

A verify step runs a request's last token and its drafts through the conv, which leaves the
state after all of them. A request that keeps only the first `keep` of those tokens needs the
state after them: the last `W - 1` conv inputs up to that point, i.e. columns `keep ..
keep + W - 2` of `[saved state before the step | the step's inputs]`. No arithmetic, a gather:
one launch per layer here, where the torch path takes five (gather the saved rows, transpose,
concatenate, gather, scatter).
"""

from __future__ import annotations

import torch

from . import tl, triton, triton_jit, use_triton

_BLOCK_C = 256


@triton_jit
def _conv_rollback_kernel(
    pool_ptr, slots_ptr, init_ptr, init_rows_ptr, x_ptr, starts_ptr, keeps_ptr,
    dim, stride_pp, stride_pc, stride_pw, stride_ip, stride_ic, stride_iw, stride_xt,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offs_c < dim
    slot = tl.load(slots_ptr + r).to(tl.int64)
    row = tl.load(init_rows_ptr + r).to(tl.int64)
    start = tl.load(starts_ptr + r).to(tl.int64)
    keep = tl.load(keeps_ptr + r).to(tl.int64)
    for p in tl.static_range(WIDTH - 1):
        src = keep + p  # column of [saved state (W - 1 columns) | inputs]
        saved = tl.load(
            init_ptr + row * stride_ip + offs_c * stride_ic + src * stride_iw,
            mask=mc & (src < WIDTH - 1), other=0.0,
        )  # fmt: skip
        fresh = tl.load(
            x_ptr + (start + src - (WIDTH - 1)) * stride_xt + offs_c,
            mask=mc & (src >= WIDTH - 1), other=0.0,
        )  # fmt: skip
        val = tl.where(src < WIDTH - 1, saved.to(tl.float32), fresh.to(tl.float32))
        tl.store(
            pool_ptr + slot * stride_pp + offs_c * stride_pc + p * stride_pw,
            val.to(pool_ptr.dtype.element_ty), mask=mc,
        )  # fmt: skip


def _rollback_torch(
    pool: torch.Tensor,
    slots: torch.Tensor,
    initial: torch.Tensor,
    initial_rows: torch.Tensor,
    x: torch.Tensor,
    starts: torch.Tensor,
    keeps: torch.Tensor,
) -> None:
    width = pool.shape[-1]
    n = slots.shape[0]
    saved = initial.index_select(0, initial_rows).transpose(1, 2).reshape(n * width, -1)
    stacked = torch.cat([saved.to(pool.dtype), x.to(pool.dtype)])
    cols = keeps[:, None] + torch.arange(width, device=keeps.device)  # [n, width]
    from_saved = cols < width
    picks = torch.where(
        from_saved,
        torch.arange(n, device=keeps.device)[:, None] * width + cols,
        n * width + starts[:, None] + cols - width,
    )
    state = stacked.index_select(0, picks.flatten()).view(n, width, -1).transpose(1, 2)
    pool.index_copy_(0, slots, state)


def causal_conv1d_rollback_(
    pool: torch.Tensor,
    slots: torch.Tensor,
    initial: torch.Tensor,
    initial_rows: torch.Tensor,
    x: torch.Tensor,
    starts: torch.Tensor,
    keeps: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Row r's conv state after the first `keeps[r]` (>= 1) of its inputs `x[starts[r]:]`
    (`x: [T, dim]`, columns contiguous), from the saved state `initial[initial_rows[r]]`
    (`[R, dim, W - 1]`), written to `pool[slots[r]]` (`[P, dim, W - 1]`); int64 device index
    tensors of one entry per row. `initial` must not alias the pool rows written."""
    dim, width = pool.shape[1], pool.shape[2] + 1
    n = slots.shape[0]
    if x.dim() != 2 or x.shape[1] != dim or x.stride(1) != 1:
        raise ValueError(f"x must be [T, {dim}] with contiguous columns, got {tuple(x.shape)}")
    if initial.shape[1:] != pool.shape[1:]:
        raise ValueError(f"initial must be [R, {dim}, {width - 1}], got {tuple(initial.shape)}")
    if any(t.shape != (n,) for t in (initial_rows, starts, keeps)):
        raise ValueError(f"initial_rows, starts and keeps must be [{n}] like slots")
    if n == 0:
        return
    if not use_triton("causal_conv1d_rollback_", pool.device, backend):
        _rollback_torch(pool, slots, initial, initial_rows, x, starts, keeps)
        return
    grid = (n, triton.cdiv(dim, _BLOCK_C))
    _conv_rollback_kernel[grid](
        pool, slots, initial, initial_rows, x, starts, keeps,
        dim, pool.stride(0), pool.stride(1), pool.stride(2),
        initial.stride(0), initial.stride(1), initial.stride(2), x.stride(0),
        WIDTH=width, BLOCK_C=_BLOCK_C,
    )  # fmt: skip
