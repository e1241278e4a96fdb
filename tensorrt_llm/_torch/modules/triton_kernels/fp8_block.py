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
are tested against and what the CPU runs.
"""

from __future__ import annotations

import torch

from .fp8_quant import FP8_MAX

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
