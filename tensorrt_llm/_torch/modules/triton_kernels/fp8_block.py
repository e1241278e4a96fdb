"""Block-scaled FP8 (e4m3) as the Qwen `-FP8` releases publish it, with torch references.

Weights: `weight` e4m3 `[N, K]` and `weight_scale_inv` fp32 `[ceil(N / bn), ceil(K / bk)]`,
the dequantized weight being `weight * scale_inv` per `bn x bk` block (the releases use 128 x
128; the last block of a dimension may be partial). A fused projection whose shards do not end
on a block boundary keeps row-granular scales instead (`bn = 1`, one row of block scales per
output row), which every entry point here accepts: the scale of weight row `n` is row
`n // bn` of `weight_scale_inv`.

Activations: per-token groups of `bk` columns (1 x 128), each quantized with its own dynamic
scale (`per_token_group_quant_fp8`).

The torch paths dequantize and multiply in float32; they are the reference the Triton kernels
are tested against and what the CPU runs. The Triton paths (`per_token_group_quant_fp8`,
`block_fp8_gemm`, `fp8_block_linear`, chosen by `use_triton` like every kernel here): one
group-quantisation kernel whose bytes equal the reference's, and a `tl.dot` GEMM on e4m3
tiles that rescales each K tile by `x_scale[m, kb] * w_scale_inv[n // bn, kb]` in fp32, with
split-K at decode sizes (see `_GEMM_TILES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton
from .fp8_quant import FP8_MAX, e4m3_row_scale, e4m3_saturate

FP8_DTYPE = torch.float8_e4m3fn
BLOCK_SIZE = (128, 128)  # (bn, bk) of the Qwen releases
_MIN_SCALE = 1e-12


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Per-element scales `[N, K]` from block scales `[ceil(N/bn), ceil(K/bk)]`."""
    bn, bk = block
    rows, cols = shape
    out = scale.float().repeat_interleave(bn, dim=0)[:rows]
    return out.repeat_interleave(bk, dim=1)[:, :cols]


def quantize_weight_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[N, K]`, fp32 scale_inv `[ceil(N/bn), ceil(K/bk)]`): each block's amax maps to
    448, the way the official releases are made."""
    if weight.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got {tuple(weight.shape)}")
    bn, bk = block
    rows, cols = weight.shape
    nb, kb = _blocks(rows, bn), _blocks(cols, bk)
    padded = weight.new_zeros(nb * bn, kb * bk, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = (amax / FP8_MAX).clamp_(min=_MIN_SCALE)
    q = (tiles / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q = q.view(nb * bn, kb * bk)[:rows, :cols].to(FP8_DTYPE)
    return q.contiguous(), scale_inv


def dequantize_weight_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK_SIZE
) -> torch.Tensor:
    """The float32 weight `[N, K]` a block-FP8 weight stands for."""
    rows, cols = weight.shape
    return weight.float() * _expand(scale_inv, block, (rows, cols))


def check_block_scales(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight"
) -> None:
    """A ValueError unless `scale_inv` has the grid `weight` and `block` call for."""
    bn, bk = block
    want = (_blocks(weight.shape[0], bn), _blocks(weight.shape[1], bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a "
            f"{tuple(weight.shape)} weight in {bn}x{bk} blocks"
        )


def per_token_group_quant_fp8_torch(
    x: torch.Tensor, group: int = BLOCK_SIZE[1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]`, fp32 scales `[M, ceil(K/group)]`): each row's groups of `group`
    columns get their own amax / 448 scale (the last group may be partial)."""
    rows, cols = x.shape
    kb = _blocks(cols, group)
    padded = x.new_zeros(rows, kb * group, dtype=torch.float32)
    padded[:, :cols] = x.float()
    tiles = padded.view(rows, kb, group)
    scale = (tiles.abs().amax(dim=-1) / FP8_MAX).clamp_(min=_MIN_SCALE)
    q = (tiles / scale[:, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(rows, kb * group)
    return q[:, :cols].to(FP8_DTYPE).contiguous(), scale


def block_fp8_gemm_torch(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    block: tuple[int, int] = BLOCK_SIZE,
) -> torch.Tensor:
    """`(xq * x_scale) @ (wq * w_scale_inv)^T` in float32, cast to `out_dtype`: `[M, N]`."""
    x = xq.float() * _expand(x_scale, (1, block[1]), tuple(xq.shape))  # type: ignore[arg-type]
    w = dequantize_weight_fp8_block(wq, w_scale_inv, block)
    return (x @ w.t()).to(out_dtype)


def fp8_block_linear_torch(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = BLOCK_SIZE,
) -> torch.Tensor:
    """`y = x @ W^T + b` for a block-FP8 weight, activations quantized per 1 x bk group (so the
    reference rounds exactly as the kernel path does): `[..., N]` in `x.dtype`."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = per_token_group_quant_fp8_torch(rows, block[1])
    out = block_fp8_gemm_torch(xq, x_scale, wq, w_scale_inv, x.dtype, block)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], wq.shape[0])


# --------------------------------------------------------------------------------------------
# Triton kernels. NOTE: every row count (M) is a runtime argument (`do_not_specialize`), and
# the tile choice depends only on the M bucket of `_GEMM_TILES`, so a batch size seen for the
# first time while serving reuses a variant compiled at warm-up (graph capture covers every
# bucket) instead of stalling the step on a compile.


@triton_jit(do_not_specialize=("rows",))
def _group_quant_kernel(
    x_ptr, q_ptr, scale_ptr, rows, cols, x_stride, q_stride, scale_stride, num_groups,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid: (rows, cdiv(num_groups, GROUPS_PER_PROG)): a [groups, GROUP_P] tile of one row.
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    inner = tl.arange(0, GROUP_P)
    offs = groups[:, None] * GROUP + inner[None, :]
    mask = (groups[:, None] < num_groups) & (inner[None, :] < GROUP) & (offs < cols)
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    # The same scale and saturation as the per-row kernel, so the bytes equal the reference.
    # NOTE: an IEEE-rounded division, as torch's: Triton's `/` on fp32 is the approximate
    # `div.full` (2 ulp), which put about one e4m3 byte in a million on the other side of a
    # rounding boundary on the H200 (4M-element inputs differed, 1M-element ones did not).
    scale = e4m3_row_scale(tl.max(tl.abs(x), axis=1), True)
    q = e4m3_saturate(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)))
    tl.store(q_ptr + row * q_stride + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * scale_stride + groups, scale, mask=groups < num_groups)


@triton_jit(do_not_specialize=("rows", "tiles_per_split"))
def _block_fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, bias_ptr,
    rows, cols, depth, tiles_per_split,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs,
    W_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid: (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), splits). A [M, K] e4m3 with scales [M, K/BK],
    # B [N, K] e4m3 with scales [N / W_BLOCK_N, K/BK]; BLOCK_K is the scale block, so each
    # K tile is one exact fp8 dot rescaled by its row and column scales in fp32. With splits
    # > 1, program z sums K tiles [z * tiles_per_split, ...) into fp32 partials at
    # c + z * stride_cs, which `_split_k_sum_kernel` adds up.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    mask_m = offs_m < rows
    mask_n = offs_n < cols
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm
    b_scale_ptrs = b_scale_ptr + (offs_n // W_BLOCK_N) * stride_bsn
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(depth, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(first, last):
        k0 = tile * BLOCK_K
        mask_k = offs_k < depth - k0
        a = tl.load(a_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs + tile, mask=mask_m, other=0.0)
        b_scale = tl.load(b_scale_ptrs + tile, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + split * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton_jit(do_not_specialize=("rows", "splits"))
def _split_k_sum_kernel(
    part_ptr, out_ptr, bias_ptr, rows, cols, splits, stride_ps, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid: (rows, cdiv(cols, BLOCK)); partials [splits, rows, cols] fp32, contiguous rows.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * stride_ps + row * cols + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers.


@dataclass(frozen=True)
class GemmTiles:
    """One row of `_GEMM_TILES`: the launch of `_block_fp8_gemm_kernel` for an M bucket."""

    max_rows: int  # the bucket holds M <= max_rows (the last bucket: any M)
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: bool  # whether K may be split when the output tiles leave SMs idle


# Keyed on M. Decode buckets (M <= 256) are bound by the weight read, so their tiles are short
# in M and, when N / BLOCK_N x M / BLOCK_M output tiles cannot fill the SMs, K is split so that
# every SM streams part of the weight. Prefill buckets are compute-bound: 128 x 128 tiles.
# Starting points; `benchmarks/bench_fp8_block.py` measures them on the H200.
_GEMM_TILES = (
    GemmTiles(16, 16, 64, 4, 4, True),
    GemmTiles(32, 32, 64, 4, 4, True),
    GemmTiles(64, 64, 64, 4, 4, True),
    GemmTiles(128, 64, 128, 4, 3, True),
    GemmTiles(256, 128, 128, 8, 3, True),
    GemmTiles(1 << 62, 128, 128, 8, 3, False),
)
_MAX_SPLITS = 16
_INTERPRETER_SMS = 132  # an H100/H200's SM count, so CPU tests exercise the same split logic


def gemm_tiles(rows: int) -> GemmTiles:
    """The `_GEMM_TILES` bucket of a GEMM with `rows` rows."""
    return next(t for t in _GEMM_TILES if rows <= t.max_rows)


@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_plan(tiles: GemmTiles, cols: int, k_tiles: int, sms: int) -> tuple[int, int]:
    """(splits, K tiles per split) for a GEMM of `cols` output columns and `k_tiles` K tiles.

    NOTE: computed from the bucket's largest M, not the actual one, so every M of a bucket
    launches the same kernel variant (a split GEMM writes fp32 partials, another variant).
    """
    m_tiles = -(-min(tiles.max_rows, 1 << 20) // tiles.block_m)
    out_tiles = m_tiles * -(-cols // tiles.block_n)
    if not tiles.split_k or out_tiles >= sms or k_tiles < 2:
        return 1, k_tiles
    splits = min(_MAX_SPLITS, k_tiles, -(-sms // out_tiles))
    per_split = -(-k_tiles // splits)
    return -(-k_tiles // per_split), per_split


def _check_gemm_args(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block: tuple[int, int],
) -> None:
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(
            f"block_fp8_gemm: xq [M, K] and wq [N, K] expected, got {tuple(xq.shape)}, "
            f"{tuple(wq.shape)}"
        )
    if min(block) <= 0:
        raise ValueError(f"block_fp8_gemm: block sizes must be positive, got {block}")
    check_block_scales(wq, w_scale_inv, block, "block_fp8_gemm wq")
    want = (xq.shape[0], _blocks(xq.shape[1], block[1]))
    if tuple(x_scale.shape) != want:
        raise ValueError(
            f"block_fp8_gemm: x_scale has shape {tuple(x_scale.shape)}, expected {want} "
            f"(one scale per row and {block[1]}-column group)"
        )


def _triton_block_k(bk: int) -> int:
    # NOTE: the kernel's K tile is the scale block itself; tl.dot on e4m3 wants K >= 32.
    if bk < 32 or bk > 256 or bk & (bk - 1):
        raise ValueError(f"block_fp8_gemm: the Triton kernel needs bk a power of two in "
                         f"[32, 256], got {bk}; use backend='torch'")  # fmt: skip
    return bk


def per_token_group_quant_fp8(
    x: torch.Tensor, group: int = BLOCK_SIZE[1], backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]`, fp32 scales `[M, ceil(K/group)]`) of `x: [M, K]` (16-bit or fp32):
    the bytes of `per_token_group_quant_fp8_torch`, from one kernel on the Triton path."""
    if x.dim() != 2:
        raise ValueError(f"per_token_group_quant_fp8: x must be [M, K], got {tuple(x.shape)}")
    if group <= 0:
        raise ValueError(f"per_token_group_quant_fp8: group must be positive, got {group}")
    if not use_triton("fp8_group_quant", x.device, backend):
        return per_token_group_quant_fp8_torch(x, group)
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    num_groups = _blocks(cols, group)
    xq = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    if rows == 0:
        return xq, scale
    group_p = triton.next_power_of_2(group)
    per_prog = min(triton.next_power_of_2(num_groups), max(1, 2048 // group_p))
    grid = (rows, triton.cdiv(num_groups, per_prog))
    _group_quant_kernel[grid](
        x, xq, scale, rows, cols, x.stride(0), xq.stride(0), scale.stride(0), num_groups,
        GROUP=group, GROUP_P=group_p, GROUPS_PER_PROG=per_prog,
        num_warps=max(1, min(8, per_prog * group_p // 256)),
        **pdl_launch_kwargs(x.device, grid[0] * grid[1]),
    )  # fmt: skip
    return xq, scale


def block_fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    block: tuple[int, int] = BLOCK_SIZE,
    backend: str = "auto",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(xq * x_scale) @ (wq * w_scale_inv)^T (+ bias)` -> `[M, N]` in `out_dtype`.

    `xq` e4m3 `[M, K]` with `x_scale` fp32 `[M, ceil(K/bk)]` (`per_token_group_quant_fp8` with
    group bk), `wq` e4m3 `[N, K]` with `w_scale_inv` `[ceil(N/bn), ceil(K/bk)]`; any bn >= 1.
    """
    _check_gemm_args(xq, x_scale, wq, w_scale_inv, block)
    if not use_triton("fp8_block_gemm", xq.device, backend):
        out = block_fp8_gemm_torch(xq, x_scale, wq, w_scale_inv, out_dtype, block)
        return out if bias is None else (out.float() + bias.float()).to(out_dtype)
    bn, bk = block
    block_k = _triton_block_k(bk)
    rows, depth = xq.shape
    cols = wq.shape[0]
    xq, x_scale = xq.contiguous(), x_scale.contiguous()
    wq, w_scale_inv = wq.contiguous(), w_scale_inv.float().contiguous()
    out = torch.empty(rows, cols, dtype=out_dtype, device=xq.device)
    if rows == 0:
        return out
    tiles = gemm_tiles(rows)
    k_tiles = _blocks(depth, block_k)
    splits, per_split = split_k_plan(tiles, cols, k_tiles, _num_sms(xq.device))
    target = out if splits == 1 else torch.empty(splits, rows, cols, device=xq.device)
    grid = (triton.cdiv(cols, tiles.block_n), triton.cdiv(rows, tiles.block_m), splits)
    _block_fp8_gemm_kernel[grid](
        xq, x_scale, wq, w_scale_inv, target, bias if bias is not None else w_scale_inv,
        rows, cols, depth, per_split,
        xq.stride(0), x_scale.stride(0), wq.stride(0), w_scale_inv.stride(0),
        target.stride(-2), target.stride(0) if splits > 1 else 0,
        W_BLOCK_N=bn, HAS_BIAS=bias is not None and splits == 1,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl_launch_kwargs(xq.device, grid[0] * grid[1] * grid[2]),
    )  # fmt: skip
    if splits > 1:
        width = min(1024, triton.next_power_of_2(cols))
        sum_grid = (rows, triton.cdiv(cols, width))
        _split_k_sum_kernel[sum_grid](
            target, out, bias if bias is not None else target, rows, cols, splits,
            target.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK=width,
            num_warps=4, **pdl_launch_kwargs(xq.device, sum_grid[0] * sum_grid[1]),
        )  # fmt: skip
    return out


def fp8_block_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] = BLOCK_SIZE,
    backend: str = "auto",
) -> torch.Tensor:
    """`y = x @ W^T + b` for a block-FP8 weight: activations quantized per 1 x bk group, then
    the block GEMM; `[..., N]` in `x.dtype`. The torch path is `fp8_block_linear_torch`."""
    if not use_triton("fp8_block_gemm", x.device, backend):
        return fp8_block_linear_torch(x, wq, w_scale_inv, bias, block)
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = per_token_group_quant_fp8(rows, block[1], backend)
    out = block_fp8_gemm(xq, x_scale, wq, w_scale_inv, x.dtype, block, backend, bias)
    return out.reshape(*x.shape[:-1], wq.shape[0])
