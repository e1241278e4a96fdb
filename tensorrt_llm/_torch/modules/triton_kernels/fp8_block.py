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

import torch

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton
from .fp8_block_gemm import triton_block_fp8_gemm
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
# Triton kernels (the GEMM itself is in fp8_block_gemm.py). Row counts are runtime arguments.


@triton_jit(do_not_specialize=("rows",))
def _group_quant_kernel(
    x_ptr, q_ptr, scale_ptr, rows, cols, x_stride, q_stride, scale_stride, scale_gstride,
    num_groups,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid: (rows_out, cdiv(num_groups, GROUPS_PER_PROG)): a [groups, GROUP_P] tile of one
    # row. Rows past `rows` are padding: zeros with scale 1.
    row = tl.program_id(0).to(tl.int64)
    valid = row < rows
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    inner = tl.arange(0, GROUP_P)
    offs = groups[:, None] * GROUP + inner[None, :]
    mask = (groups[:, None] < num_groups) & (inner[None, :] < GROUP) & (offs < cols)
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask & valid, other=0.0).to(tl.float32)
    scale = e4m3_row_scale(tl.max(tl.abs(x), axis=1), valid)
    q = group_quant_values(x, scale)
    tl.store(q_ptr + row * q_stride + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    scale_ptrs = scale_ptr + row * scale_stride + groups * scale_gstride
    tl.store(scale_ptrs, scale, mask=groups < num_groups)


@triton_jit
def group_quant_values(x, scale):
    # `x [..., groups, GROUP]` over its group scales `[..., groups]`, saturated to e4m3's
    # range: the one rounding every group-quantising kernel shares, so fused and separate
    # quantisation give the reference's bytes.
    # NOTE: an IEEE-rounded division, as torch's: Triton's `/` on fp32 is the approximate
    # `div.full` (2 ulp), which put about one e4m3 byte in a million on the other side of a
    # rounding boundary on the H200 (4M-element inputs differed, 1M-element ones did not).
    return e4m3_saturate(tl.math.div_rn(x, tl.broadcast_to(tl.expand_dims(scale, -1), x.shape)))


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


def group_scales(rows: int, groups: int, device: torch.device, m_major: bool) -> torch.Tensor:
    """An empty fp32 `[rows, groups]` scale tensor, M-major (stride `(1, rows)`) or not."""
    if m_major:
        return torch.empty(groups, rows, dtype=torch.float32, device=device).t()
    return torch.empty(rows, groups, dtype=torch.float32, device=device)


def pad_group_quant(
    xq: torch.Tensor, scale: torch.Tensor, rows_out: int, m_major: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch-path padding to `rows_out` rows (zeros, scale 1) in the layout asked for."""
    rows, groups = scale.shape
    if rows_out > rows:
        xq = torch.cat([xq, xq.new_zeros(rows_out - rows, xq.shape[1])])
        scale = torch.cat([scale, scale.new_ones(rows_out - rows, groups)])
    if m_major:
        out = group_scales(rows_out, groups, scale.device, True)
        scale = out.copy_(scale)
    return xq, scale


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group: int = BLOCK_SIZE[1],
    backend: str = "auto",
    m_major: bool = False,
    rows_out: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]`, fp32 scales `[M, ceil(K/group)]`) of `x: [M, K]` (16-bit or fp32):
    the bytes of `per_token_group_quant_fp8_torch`, from one kernel on the Triton path.
    `m_major` stores the scales M-major (stride `(1, M)`), the layout cuBLASLt reads;
    `rows_out` pads to that many rows (zeros, scale 1), as cuBLASLt wants multiples of 16."""
    if x.dim() != 2:
        raise ValueError(f"per_token_group_quant_fp8: x must be [M, K], got {tuple(x.shape)}")
    if group <= 0:
        raise ValueError(f"per_token_group_quant_fp8: group must be positive, got {group}")
    rows, cols = x.shape
    total = rows if rows_out is None else rows_out
    if total < rows:
        raise ValueError(f"per_token_group_quant_fp8: rows_out {total} < rows {rows}")
    if not use_triton("fp8_group_quant", x.device, backend):
        return pad_group_quant(*per_token_group_quant_fp8_torch(x, group), total, m_major)
    if x.stride(1) != 1:
        x = x.contiguous()
    num_groups = _blocks(cols, group)
    xq = torch.empty(total, cols, dtype=FP8_DTYPE, device=x.device)
    scale = group_scales(total, num_groups, x.device, m_major)
    if total == 0:
        return xq, scale
    group_p = triton.next_power_of_2(group)
    per_prog = min(triton.next_power_of_2(num_groups), max(1, 2048 // group_p))
    grid = (total, triton.cdiv(num_groups, per_prog))
    _group_quant_kernel[grid](
        x, xq, scale, rows, cols, x.stride(0), xq.stride(0), scale.stride(0), scale.stride(1),
        num_groups, GROUP=group, GROUP_P=group_p, GROUPS_PER_PROG=per_prog,
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
    group bk, either layout), `wq` e4m3 `[N, K]` with `w_scale_inv` `[ceil(N/bn), ceil(K/bk)]`;
    any bn >= 1. The Triton launch is `fp8_block_gemm.triton_block_fp8_gemm`.
    """
    _check_gemm_args(xq, x_scale, wq, w_scale_inv, block)
    if not use_triton("fp8_block_gemm", xq.device, backend):
        out = block_fp8_gemm_torch(xq, x_scale, wq, w_scale_inv, out_dtype, block)
        return out if bias is None else (out.float() + bias.float()).to(out_dtype)
    _triton_block_k(block[1])
    return triton_block_fp8_gemm(
        xq.contiguous(), x_scale, wq.contiguous(), w_scale_inv, out_dtype, block, bias
    )


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
