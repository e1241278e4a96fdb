"""The torch paths of the fused MoE kernel (`fused_moe.py`): its CPU/fallback compute and the
reference the tests hold it to. They live with the kernel, so the kernel never imports the
MoE layer that calls it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _swiglu_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def fused_moe_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]); x [T, H] -> [T, H].

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
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        y = _swiglu_expert(x.index_select(0, rows), gate_up_proj[expert], down_proj[expert])
        out.index_add_(0, rows, (y * weights[start : start + count, None]).float())
        start += count
    return out.to(x.dtype)


def fused_moe_dense_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Same result as `fused_moe_ref`, computed for every expert on every token (no host sync)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up_proj.shape[0]):
        scale = (topk_weights * (topk_ids == expert)).sum(dim=-1, keepdim=True)
        y = _swiglu_expert(x, gate_up_proj[expert], down_proj[expert])
        out += (y * scale).float()
    return out.to(x.dtype)
