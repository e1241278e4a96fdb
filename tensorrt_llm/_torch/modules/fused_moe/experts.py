"""The routed experts of the sparse MoE block: their stacked weights and the expert compute.

Expert weights are stacked like transformers 5.x: `experts.gate_up_proj: [E, 2*I, H]` (gate rows
first) and `experts.down_proj: [E, H, I]`, the layout a grouped-GEMM kernel wants
(`expert_weights.py` converts a checkpoint's expert entries into it).

Block-FP8 experts (the `-FP8` releases): e4m3 weights with their `weight_scale_inv` stay FP8
(`fp8_experts.py` has the layout). A module is block-FP8 when built with `weight_block_size`,
or when `prepare_fp8_block_experts_` sees scale tensors for it among the converted weights
(what `MoE.load_weights` and the MoE models' `load_weights` do before loading); 16-bit experts
convert with `MoEExperts.quantize_fp8_block_()` (random-weight benchmarks).

Torch reference compute: `fused_moe_ref` sorts the (token, expert) pairs by expert and runs one
gather -> SwiGLU -> scatter-add per expert that received tokens. It reads the per-expert counts
on the host once per call. `fused_moe_dense_ref` runs every expert on every token with masked
weights and never syncs with the host, so it is the path taken inside CUDA-graph capture.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..triton_kernels.fp8_block import BLOCK_SIZE, FP8_DTYPE
from ..triton_kernels.fused_moe import fused_moe
from ..triton_kernels.fused_moe_ref import BlockScales
from ..triton_kernels.moe_routing import Layout
from .fp8_experts import SCALE_SUFFIX, gate_up_block, quantize_expert_fp8_block


class MoEExperts(nn.Module):
    """The routed experts' stacked weights and the reference expert compute."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype | None = None,
        weight_block_size: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if min(num_experts, hidden_size, intermediate_size) <= 0:
            raise ValueError("MoEExperts sizes must be positive")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        # (bn, bk) of the block-FP8 weights, None for 16-bit experts.
        self.weight_block_size: tuple[int, int] | None = None
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype)
        )
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None
        if weight_block_size is not None:
            self.use_fp8_block_(weight_block_size)

    def use_fp8_block_(self, block: tuple[int, int] = BLOCK_SIZE) -> None:
        """Give this (not yet loaded) module block-FP8 storage on its device: e4m3 weights and
        fp32 `*_scale_inv` parameters, uninitialised until the weights are loaded."""
        if self.weight_block_size is not None:
            raise ValueError(f"MoEExperts is block-FP8 already ({self.weight_block_size})")
        bn, bk = block
        if bn <= 0 or bk <= 0:
            raise ValueError(f"weight_block_size must be positive, got {block}")
        num, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        dev = self.gate_up_proj.device
        gate_rows = -(-2 * inter // gate_up_block(inter, block)[0])

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=dev), requires_grad=False)

        self.gate_up_proj = param(num, 2 * inter, hidden, dtype=FP8_DTYPE)
        self.gate_up_proj_scale_inv = param(num, gate_rows, -(-hidden // bk), dtype=torch.float32)
        self.down_proj = param(num, hidden, inter, dtype=FP8_DTYPE)
        self.down_proj_scale_inv = param(
            num, -(-hidden // bn), -(-inter // bk), dtype=torch.float32
        )
        self.weight_block_size = (bn, bk)

    @torch.no_grad()
    def quantize_fp8_block_(self, block: tuple[int, int] = BLOCK_SIZE) -> None:
        """Convert loaded 16-bit experts to block FP8 in place, one expert at a time, by the
        releases' rule (`quantize_weight_fp8_block` on gate, up and down separately)."""
        if self.weight_block_size is not None:
            raise ValueError("quantize_fp8_block_: the experts are block-FP8 already")
        gate_up, down = self.gate_up_proj.data, self.down_proj.data
        self.use_fp8_block_(block)
        assert self.gate_up_proj_scale_inv is not None and self.down_proj_scale_inv is not None
        for e in range(self.num_experts):
            w13, s13, w2, s2 = quantize_expert_fp8_block(gate_up[e], down[e], block)
            self.gate_up_proj[e].copy_(w13)
            self.gate_up_proj_scale_inv[e].copy_(s13)
            self.down_proj[e].copy_(w2)
            self.down_proj_scale_inv[e].copy_(s2)

    def block_scales(self) -> BlockScales | None:
        """The FP8 experts' scales for `fused_moe`, None for 16-bit experts."""
        if self.weight_block_size is None:
            return None
        assert self.gate_up_proj_scale_inv is not None and self.down_proj_scale_inv is not None
        return BlockScales(
            self.gate_up_proj_scale_inv,
            self.down_proj_scale_inv,
            gate_up_block(self.intermediate_size, self.weight_block_size),
            self.weight_block_size,
        )

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: Layout | None = None,
        dropped: bool = False,
    ) -> torch.Tensor:
        # Triton grouped GEMM on CUDA (graph-safe); torch reference elsewhere. `layout`: the
        # routing kernel's aligned pairs (`expert_plan`), saving the alignment launch;
        # `dropped`: ids may be E (pairs of other ranks' experts, `local_routing`).
        return fused_moe(
            x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights,
            scales=self.block_scales(), layout=layout, dropped=dropped,
        )  # fmt: skip

    def extra_repr(self) -> str:
        fp8 = "" if self.weight_block_size is None else f", fp8_block={self.weight_block_size}"
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}{fp8}"
        )


def prepare_fp8_block_experts_(
    model: nn.Module, weights: Mapping[str, torch.Tensor], block: tuple[int, int] = BLOCK_SIZE
) -> int:
    """Switch every 16-bit `MoEExperts` of `model` whose converted weights (named relative to
    `model`, `convert_hf_expert_weights`' output) carry block scales to block-FP8 storage, so
    loading keeps them FP8. Returns how many switched. Call before `load_hf_weights`."""
    switched = 0
    for name, module in model.named_modules():
        if not isinstance(module, MoEExperts) or module.weight_block_size is not None:
            continue
        prefix = f"{name}." if name else ""
        if any(f"{prefix}{p}{SCALE_SUFFIX}" in weights for p in ("gate_up_proj", "down_proj")):
            module.use_fp8_block_(block)
            switched += 1
    return switched
