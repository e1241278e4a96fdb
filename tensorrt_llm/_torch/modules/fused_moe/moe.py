"""Sparse MoE block (top-k softmax routing, SwiGLU experts, optional gated shared expert).

Covers Qwen3-MoE / Qwen3-VL-MoE (routed experts only) and Qwen3.5-MoE / Qwen3-Next (plus a
shared expert scaled by `sigmoid(shared_expert_gate(x))`).

The routed experts (`MoEExperts`: stacked weights, block FP8, the expert compute) are in
`experts.py`, the checkpoint conversion into their layout (`convert_hf_expert_weights`) in
`expert_weights.py`; both re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ....mapping import Mapping as ParallelMapping
from ..gated_mlp import GatedMLP
from ..linear import Linear
from ..triton_kernels import use_triton
from ..triton_kernels.fp8_block import BLOCK_SIZE
from ..triton_kernels.fused_moe import expert_plan
from ..triton_kernels.fused_moe_ref import (  # noqa: F401 (re-exported: the torch references)
    fused_moe_dense_ref,
    fused_moe_ref,
)
from .expert_parallel import combine_expert_parallel, expert_range
from .expert_weights import convert_hf_expert_weights
from .experts import MoEExperts, prepare_fp8_block_experts_
from .router import TopKRouter
from .shared_fusion import fuse_shared_expert

# Model types whose HF MoE block reads `norm_topk_prob`; the others always renormalise.
_CONFIGURABLE_NORM_TOPK = ("qwen2_moe", "qwen3_moe", "qwen3_next")


class MoE(nn.Module):
    """`experts(x) [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)]` over [T, hidden].

    After loading, a shared expert as wide as the routed ones joins them as expert E, its gate
    as router row E (`fuse_shared_expert_`, shared_fusion.py): one routed pass computes both.

    Expert parallelism (`mapping.moe_ep_size > 1`, expert_parallel.py): `experts` holds this
    rank's share, routing stays global; a tensor-parallel shared expert's partial output joins
    the routed one before the layer's single all-reduce.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        shared_expert_intermediate_size: int | None = None,
        norm_topk_prob: bool = True,
        dtype: torch.dtype | None = None,
        weight_block_size: tuple[int, int] | None = None,
        mapping: ParallelMapping | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.mapping = mapping if mapping is not None else ParallelMapping()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob, dtype=dtype)
        # (first expert, count) of this rank; None without expert parallelism.
        self.local_experts: tuple[int, int] | None = None
        if self.mapping.moe_ep_size > 1:
            self.local_experts = expert_range(num_experts, self.mapping)
        self.experts = MoEExperts(
            self.local_experts[1] if self.local_experts else num_experts,
            hidden_size, intermediate_size, dtype=dtype, weight_block_size=weight_block_size,
        )  # fmt: skip
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        self.shared_fused = False  # the shared expert is expert E of `experts` (see above)
        if shared_expert_intermediate_size:
            # Under expert parallelism the shared expert is tensor-parallel (column gate_up,
            # row down_proj, reduced with the routed sum); its one-row gate stays whole.
            self.shared_expert = GatedMLP(
                hidden_size, shared_expert_intermediate_size, dtype=dtype,
                mapping=self.mapping if self.local_experts is not None else None,
            )  # fmt: skip
            self.shared_expert_gate = Linear(hidden_size, 1, dtype=dtype)

    @classmethod
    def from_config(
        cls,
        config: Any,
        dtype: torch.dtype | None = None,
        weight_block_size: tuple[int, int] | None = None,
        mapping: ParallelMapping | None = None,
    ) -> MoE:
        """Build from an HF Qwen3-MoE / Qwen3-VL-MoE / Qwen3.5-MoE / Qwen3-Next text config;
        `weight_block_size` builds the routed experts block-FP8 (a `-FP8` checkpoint)."""
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"MoE supports hidden_act='silu' only, got {act!r}")
        norm = True
        if getattr(config, "model_type", None) in _CONFIGURABLE_NORM_TOPK:
            norm = bool(getattr(config, "norm_topk_prob", True))
        return cls(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            shared_expert_intermediate_size=getattr(
                config, "shared_expert_intermediate_size", None
            ),
            norm_topk_prob=norm,
            dtype=dtype,
            weight_block_size=weight_block_size,
            mapping=mapping,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoE expects last dim {self.hidden_size}, got {tuple(hidden_states.shape)}"
            )
        x = hidden_states.reshape(-1, self.hidden_size)
        experts = self.experts
        block_m = None  # expert parallelism renumbers the pairs after routing: no layout then
        if self.local_experts is None and use_triton("moe_route", x.device, "auto"):
            top_k = self.gate.top_k + int(self.shared_fused)
            fp8 = experts.weight_block_size is not None
            block_m = expert_plan(x.shape[0], top_k, experts.num_experts, fp8)
        topk_weights, topk_ids, layout = self.gate.route(x, block_m)
        if self.local_experts is not None:
            out = combine_expert_parallel(self, x, topk_ids, topk_weights)
            return out.reshape(hidden_states.shape)
        out = experts(x, topk_ids, topk_weights, layout)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(hidden_states.shape)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load HF weights named relative to this block (`gate.weight`, `experts...`,
        `shared_expert.{gate,up,down}_proj.weight`, `shared_expert_gate.weight`); block-FP8
        experts (e4m3 with `weight_scale_inv`) stay FP8."""
        # Imported here: the models package imports the modules, not the other way round.
        from ...weight_loading import load_hf_weights

        if self.shared_fused:
            raise ValueError("MoE.load_weights after fuse_shared_expert_: load, then fuse")
        experts = self.experts
        converted = convert_hf_expert_weights(
            weights,
            num_experts=experts.num_experts,
            hidden_size=experts.hidden_size,
            intermediate_size=experts.intermediate_size,
            weight_block_size=experts.weight_block_size or BLOCK_SIZE,
        )
        prepare_fp8_block_experts_(self, converted, experts.weight_block_size or BLOCK_SIZE)
        load_hf_weights(self, converted)
        self.fuse_shared_expert_()

    def fuse_shared_expert_(self) -> bool:
        """Run the shared expert as routed expert E when it can (shared_fusion.py, which lists
        when it cannot); returns whether it fused now. Call after loading the weights."""
        return fuse_shared_expert(self)
