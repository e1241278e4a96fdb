"""Sparse MoE block (top-k softmax routing, SwiGLU experts, optional gated shared expert).

Covers Qwen3-MoE / Qwen3-VL-MoE (routed experts only) and Qwen3.5-MoE / Qwen3-Next (plus a
shared expert scaled by `sigmoid(shared_expert_gate(x))`).

Expert weights are stacked like transformers 5.x: `experts.gate_up_proj: [E, 2*I, H]` (gate rows
first) and `experts.down_proj: [E, H, I]`, the layout a grouped-GEMM kernel wants.
`convert_hf_expert_weights` also accepts the hub's per-expert
`experts.N.{gate,up,down}_proj.weight` and Qwen3-VL-MoE's transposed stacks
(`[E, H, 2*I]`, `[E, I, H]`).

Torch reference compute: `fused_moe_ref` sorts the (token, expert) pairs by expert and runs one
gather -> SwiGLU -> scatter-add per expert that received tokens. It reads the per-expert counts
on the host once per call. `fused_moe_dense_ref` runs every expert on every token with masked
weights and never syncs with the host, so it is the path taken inside CUDA-graph capture.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..gated_mlp import GatedMLP
from ..linear import Linear
from ..triton_kernels.fused_moe import fused_moe
from ..triton_kernels.fused_moe_ref import fused_moe_dense_ref, fused_moe_ref  # noqa: F401
from .router import TopKRouter

# Model types whose HF MoE block reads `norm_topk_prob`; the others always renormalise.
_CONFIGURABLE_NORM_TOPK = ("qwen2_moe", "qwen3_moe", "qwen3_next")
_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?experts\.)(?P<idx>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>(?:.*\.)?experts\.)(?P<proj>gate_up_proj|down_proj)$")


class MoEExperts(nn.Module):
    """The routed experts' stacked weights and the reference expert compute."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if min(num_experts, hidden_size, intermediate_size) <= 0:
            raise ValueError("MoEExperts sizes must be positive")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype)
        )

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        # Triton grouped GEMM on CUDA (graph-safe); torch reference elsewhere.
        return fused_moe(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}"
        )


def _stack_per_expert(
    groups: dict[str, dict[int, dict[str, torch.Tensor]]], num_experts: int
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for prefix, experts in groups.items():
        missing = [
            f"{prefix}{e}.{proj}.weight"
            for e in range(num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
            if proj not in experts.get(e, {})
        ]
        extra = sorted(set(experts) - set(range(num_experts)))
        if missing or extra:
            raise ValueError(
                f"per-expert weights under {prefix!r} do not match {num_experts} experts: "
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, extra experts {extra}"
            )
        mats = [experts[e] for e in range(num_experts)]
        out[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([m["gate_proj"], m["up_proj"]]) for m in mats]
        )
        out[prefix + "down_proj"] = torch.stack([m["down_proj"] for m in mats])
    return out


def _orient(name: str, tensor: torch.Tensor, want: tuple[int, int, int]) -> torch.Tensor:
    """Stacked tensor in our orientation; transposes Qwen3-VL-MoE's hub layout.

    NOTE: when both orientations have the same shape (H == 2*I for gate_up, H == I for down)
    the tensor is taken as already in our layout, as transformers does.
    """
    if tuple(tensor.shape) == want:
        return tensor
    if tensor.dim() == 3 and tuple(tensor.shape) == (want[0], want[2], want[1]):
        return tensor.transpose(1, 2).contiguous()
    raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {want} or its transpose")


def convert_hf_expert_weights(
    weights: Mapping[str, torch.Tensor],
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
) -> dict[str, torch.Tensor]:
    """Rewrite every MoE expert entry of an HF checkpoint into `*experts.gate_up_proj` /
    `*experts.down_proj` in our layout; other entries pass through unchanged."""
    wants = {
        "gate_up_proj": (num_experts, 2 * intermediate_size, hidden_size),
        "down_proj": (num_experts, hidden_size, intermediate_size),
    }
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        per_expert = _PER_EXPERT.match(name)
        stacked = _STACKED.match(name)
        if per_expert and per_expert["proj"] in ("gate_proj", "up_proj", "down_proj"):
            expert = groups.setdefault(per_expert["prefix"], {})
            expert.setdefault(int(per_expert["idx"]), {})[per_expert["proj"]] = tensor
        elif stacked:
            out[name] = _orient(name, tensor, wants[stacked["proj"]])
        else:
            out[name] = tensor
    stacked_names = _stack_per_expert(groups, num_experts)
    clash = sorted(set(stacked_names) & set(out))
    if clash:
        raise ValueError(f"checkpoint has both per-expert and stacked weights for {clash}")
    out.update(stacked_names)
    return out


class MoE(nn.Module):
    """`experts(x) [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)]` over [T, hidden]."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        shared_expert_intermediate_size: int | None = None,
        norm_topk_prob: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob, dtype=dtype)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size, dtype=dtype)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, dtype=dtype)
            self.shared_expert_gate = Linear(hidden_size, 1, dtype=dtype)

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype | None = None) -> MoE:
        """Build from an HF Qwen3-MoE / Qwen3-VL-MoE / Qwen3.5-MoE / Qwen3-Next text config."""
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
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoE expects last dim {self.hidden_size}, got {tuple(hidden_states.shape)}"
            )
        x = hidden_states.reshape(-1, self.hidden_size)
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(hidden_states.shape)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load HF weights named relative to this block (`gate.weight`, `experts...`,
        `shared_expert.{gate,up,down}_proj.weight`, `shared_expert_gate.weight`)."""
        # Imported here: the models package imports the modules, not the other way round.
        from ...weight_loading import load_hf_weights

        experts = self.experts
        converted = convert_hf_expert_weights(
            weights,
            num_experts=experts.num_experts,
            hidden_size=experts.hidden_size,
            intermediate_size=experts.intermediate_size,
        )
        load_hf_weights(self, converted)
