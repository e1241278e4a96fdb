"""Qwen3-VL / Qwen3.5 vision position embeddings: bilinear resampling fused with the merge reorder.

The learned table is a `side x side` grid (row `r*side + c`). Each item `(t, h, w)` resamples it
to `h x w` with corners aligned (point i of n sits at `i*(side-1)/(n-1)` on the table grid), emits
the patches in merge-window order (merge x merge blocks in raster order, raster order inside a
block) and repeats that for each of the t frames. Same result as
`models/modeling_qwen3vl_vision.py::interpolate_pos_embed_reference`.

NOTE: tap coordinates use exact integer math: `i*(side-1) = lo*(n-1) + rem`, weight
`rem/(n-1)`, so floor() never lands on the wrong side of a grid point.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import tl, triton, triton_jit, use_triton

_BLOCK_ROWS = 16
_MAX_BLOCK_D = 128


# NOTE: the grid's h and w change with every image size; specialized, each new size class (1,
# multiples of 16) would compile inside a served step, which no startup warm-up can cover.
@triton_jit(do_not_specialize=("h", "w"))
def _pos_embed_interp_kernel(
    table_ptr,
    out_ptr,
    table_stride,
    out_stride,
    dim,
    h,
    w,
    side,
    MERGE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (cdiv(h*w, BLOCK_ROWS), cdiv(dim, BLOCK_D), frames); out_ptr is the item's first row.
    # Frames recompute the same rows: cheaper than a serial loop, and the taps stay in L2.
    p = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_p = p < h * w
    mask = mask_p[:, None] & (d < dim)[None, :]
    # Merge-window order -> (row, col) on the h x w grid.
    block = p // (MERGE * MERGE)
    row = (block // (w // MERGE)) * MERGE + (p // MERGE) % MERGE
    col = (block % (w // MERGE)) * MERGE + p % MERGE
    den_h = tl.maximum(h - 1, 1)
    den_w = tl.maximum(w - 1, 1)
    r0 = (row * (side - 1)) // den_h
    c0 = (col * (side - 1)) // den_w
    fr = ((row * (side - 1)) % den_h).to(tl.float32) / den_h.to(tl.float32)
    fc = ((col * (side - 1)) % den_w).to(tl.float32) / den_w.to(tl.float32)
    r1 = tl.minimum(r0 + 1, side - 1)
    c1 = tl.minimum(c0 + 1, side - 1)
    dd = d[None, :]
    t00 = tl.load(table_ptr + (r0 * side + c0).to(tl.int64)[:, None] * table_stride + dd, mask=mask)
    t01 = tl.load(table_ptr + (r0 * side + c1).to(tl.int64)[:, None] * table_stride + dd, mask=mask)
    t10 = tl.load(table_ptr + (r1 * side + c0).to(tl.int64)[:, None] * table_stride + dd, mask=mask)
    t11 = tl.load(table_ptr + (r1 * side + c1).to(tl.int64)[:, None] * table_stride + dd, mask=mask)
    fc2 = fc[:, None]
    fr2 = fr[:, None]
    top = t00.to(tl.float32) * (1.0 - fc2) + t01.to(tl.float32) * fc2
    bottom = t10.to(tl.float32) * (1.0 - fc2) + t11.to(tl.float32) * fc2
    emb = (top * (1.0 - fr2) + bottom * fr2).to(out_ptr.dtype.element_ty)
    out_row = tl.program_id(2).to(tl.int64) * h * w + p
    tl.store(out_ptr + out_row[:, None] * out_stride + dd, emb, mask=mask)


def _interp_item_torch(
    table: torch.Tensor, h: int, w: int, side: int, merge: int, out: torch.Tensor
) -> None:
    """Torch twin of the kernel for one item; `out: [t*h*w, D]` is written in place."""
    dev = table.device
    p = torch.arange(h * w, device=dev)
    block = p // (merge * merge)
    row = (block // (w // merge)) * merge + (p // merge) % merge
    col = (block % (w // merge)) * merge + p % merge

    def taps(pos: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        den = max(n - 1, 1)
        lo = (pos * (side - 1)) // den
        frac = ((pos * (side - 1)) % den).float() / den
        return lo, (lo + 1).clamp(max=side - 1), frac[:, None]

    r0, r1, fr = taps(row, h)
    c0, c1, fc = taps(col, w)
    flat = table[: side * side].float()
    top = flat[r0 * side + c0] * (1 - fc) + flat[r0 * side + c1] * fc
    bottom = flat[r1 * side + c0] * (1 - fc) + flat[r1 * side + c1] * fc
    emb = (top * (1 - fr) + bottom * fr).to(out.dtype)
    out.view(-1, h * w, out.shape[-1]).copy_(emb.expand(out.shape[0] // (h * w), -1, -1))


def _check_grids(grids: Sequence[Sequence[int]], merge: int) -> list[tuple[int, int, int]]:
    checked = []
    for grid in grids:
        if len(grid) != 3:
            raise ValueError(f"each grid must be (t, h, w), got {tuple(grid)}")
        t, h, w = (int(v) for v in grid)
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise ValueError(
                f"grid (t={t}, h={h}, w={w}) must be positive with h, w divisible by merge {merge}"
            )
        checked.append((t, h, w))
    if not checked:
        raise ValueError("interpolate_pos_embed needs at least one grid")
    return checked


def interpolate_pos_embed(
    pos_embed_weight: torch.Tensor,
    grids: Sequence[Sequence[int]],
    num_grid_per_side: int,
    merge_size: int,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`[sum(t*h*w), D]` resampled position embeddings for host `grids` [(t, h, w), ...].

    pos_embed_weight: `[>= side*side, D]`; math in fp32; result in `out_dtype` (default: the
    weight's dtype). One launch per item; no host sync (grids are host ints).
    """
    side = int(num_grid_per_side)
    merge = int(merge_size)
    if side < 1 or merge < 1:
        raise ValueError(f"num_grid_per_side {side} and merge_size {merge} must be positive")
    if pos_embed_weight.dim() != 2 or pos_embed_weight.shape[0] < side * side:
        raise ValueError(
            f"pos_embed_weight must be [>= {side * side}, D], got {tuple(pos_embed_weight.shape)}"
        )
    checked = _check_grids(grids, merge)
    dim = pos_embed_weight.shape[1]
    total = sum(t * h * w for t, h, w in checked)
    out_dtype = pos_embed_weight.dtype if out_dtype is None else out_dtype
    out = torch.empty(total, dim, dtype=out_dtype, device=pos_embed_weight.device)
    triton_path = use_triton("interpolate_pos_embed", pos_embed_weight.device, backend)
    table = pos_embed_weight
    if triton_path and table.stride(1) != 1:
        table = table.contiguous()
    start = 0
    for t, h, w in checked:
        item = out[start : start + t * h * w]
        start += t * h * w
        if not triton_path:
            _interp_item_torch(table, h, w, side, merge, item)
            continue
        block_d = min(_MAX_BLOCK_D, triton.next_power_of_2(dim))
        grid = (triton.cdiv(h * w, _BLOCK_ROWS), triton.cdiv(dim, block_d), t)
        _pos_embed_interp_kernel[grid](
            table, item, table.stride(0), item.stride(0), dim, h, w, side,
            MERGE=merge, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_D=block_d,
        )  # fmt: skip
    return out
