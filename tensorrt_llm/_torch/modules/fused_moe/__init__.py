"""Mixture-of-experts: top-k softmax routing and the sparse MoE block (torch reference)."""

from __future__ import annotations

from .moe import (
    MoE,
    MoEExperts,
    convert_hf_expert_weights,
    fused_moe_dense_ref,
    fused_moe_ref,
    prepare_fp8_block_experts_,
)
from .router import TopKRouter, softmax_topk
from .shared_fusion import fuse_shared_experts_

__all__ = [
    "MoE",
    "MoEExperts",
    "TopKRouter",
    "convert_hf_expert_weights",
    "fuse_shared_experts_",
    "fused_moe_dense_ref",
    "fused_moe_ref",
    "prepare_fp8_block_experts_",
    "softmax_topk",
]
