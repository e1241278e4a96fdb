"""The torch paths of the fused MoE kernel (`fused_moe.py`): its CPU/fallback compute and the
reference the tests hold it to. They live with the kernel, so the kernel never imports the
MoE layer that calls it.

Block-FP8 experts (`scales`): each GEMM quantizes its input per 1 x bk group and multiplies by
the dequantized weight in float32 (`fp8_block.py`), with the SwiGLU in float32 and `act`
rounded to x's dtype before its quantization, as the kernel does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fp8_block import BLOCK_SIZE, block_fp8_gemm_torch, per_token_group_quant_fp8_torch


@dataclass(frozen=True)
class BlockScales:
    """The block scales of e4m3 expert weights (`weight * scale_inv` per block, fp8_block.py).

    `gate_up`: fp32 `[E, ceil(2I / bn), ceil(H / bk)]` with `gate_up_block = (bn, bk)`
    (bn = 1 keeps gate and up exact when I is not a multiple of the releases' 128);
    `down`: fp32 `[E, ceil(H / bn), ceil(I / bk)]` with `down_block`.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_block: tuple[int, int] = BLOCK_SIZE
    down_block: tuple[int, int] = BLOCK_SIZE


def _block_linear_fp32(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    xq, x_scale = per_token_group_quant_fp8_torch(x, block[1])
    return block_fp8_gemm_torch(xq, x_scale, w, scale, torch.float32, block)


def _swiglu_expert(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    scales: BlockScales | None = None,
    expert: int = 0,
) -> torch.Tensor:
    if scales is None:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)
    gate, up = _block_linear_fp32(x, gate_up, scales.gate_up[expert], scales.gate_up_block).chunk(
        2, dim=-1
    )
    act = (F.silu(gate) * up).to(x.dtype)
    return _block_linear_fp32(act, down, scales.down[expert], scales.down_block)


def fused_moe_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    scales: BlockScales | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]); x [T, H] -> [T, H].

    An id E is a dropped pair (`fused_moe(dropped=True)`): skipped, it adds nothing.
    NOTE: one host sync per call (the per-expert token counts); the dense variant has none.
    """
    num_experts, top_k = gate_up_proj.shape[0], topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k  # the token of each (token, k) pair, grouped by expert
    weights = topk_weights.reshape(-1)[order]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    # Dropped pairs (id E) sort last: the runs of the E real experts come first.
    for expert, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        y = _swiglu_expert(
            x.index_select(0, rows), gate_up_proj[expert], down_proj[expert], scales, expert
        )
        out.index_add_(0, rows, (y * weights[start : start + count, None]).float())
        start += count
    return out.to(x.dtype)


def fused_moe_dense_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    scales: BlockScales | None = None,
) -> torch.Tensor:
    """Same result as `fused_moe_ref`, computed for every expert on every token (no host sync);
    a dropped pair's id E matches no expert's mask."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up_proj.shape[0]):
        scale = (topk_weights * (topk_ids == expert)).sum(dim=-1, keepdim=True)
        y = _swiglu_expert(x, gate_up_proj[expert], down_proj[expert], scales, expert)
        out += (y * scale).float()
    return out.to(x.dtype)
