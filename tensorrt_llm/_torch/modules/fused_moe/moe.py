"""Sparse MoE block (top-k softmax routing, SwiGLU experts, optional gated shared expert).

Covers Qwen3-MoE / Qwen3-VL-MoE (routed experts only) and Qwen3.5-MoE / Qwen3-Next (plus a
shared expert scaled by `sigmoid(shared_expert_gate(x))`).

Expert weights are stacked like transformers 5.x: `experts.gate_up_proj: [E, 2*I, H]` (gate rows
first) and `experts.down_proj: [E, H, I]`, the layout a grouped-GEMM kernel wants.
`convert_hf_expert_weights` also accepts the hub's per-expert
`experts.N.{gate,up,down}_proj.weight` and Qwen3-VL-MoE's transposed stacks
(`[E, H, 2*I]`, `[E, I, H]`).

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

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ....mapping import Mapping as ParallelMapping
from ..gated_mlp import GatedMLP
from ..linear import Linear
from ..triton_kernels import use_triton
from ..triton_kernels.fp8_block import BLOCK_SIZE, FP8_DTYPE
from ..triton_kernels.fused_moe import expert_plan, fused_moe
from ..triton_kernels.fused_moe_ref import (  # noqa: F401
    BlockScales,
    fused_moe_dense_ref,
    fused_moe_ref,
)
from ..triton_kernels.moe_routing import Layout
from .expert_parallel import combine_expert_parallel, expert_range
from .fp8_experts import (
    SCALE_SUFFIX,
    check_fp8_pair,
    gate_up_block,
    is_float8,
    quantize_expert_fp8_block,
    stack_per_expert_fp8,
    stacked_scale_fp8,
)
from .router import TopKRouter
from .shared_fusion import fuse_shared_expert

# Model types whose HF MoE block reads `norm_topk_prob`; the others always renormalise.
_CONFIGURABLE_NORM_TOPK = ("qwen2_moe", "qwen3_moe", "qwen3_next")
_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts\.)(?P<idx>\d+)\.(?P<proj>\w+)\.weight(?P<scale>_scale_inv)?$"
)
_STACKED = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts\.)(?P<proj>gate_up_proj|down_proj)(?P<scale>_scale_inv)?$"
)


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


def _stack_per_expert(
    groups: dict[str, dict[int, dict[str, torch.Tensor]]],
    num_experts: int,
    block: tuple[int, int],
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    projs = ("gate_proj", "up_proj", "down_proj")
    for prefix, experts in groups.items():
        missing = [
            f"{prefix}{e}.{proj}.weight"
            for e in range(num_experts)
            for proj in projs
            if proj not in experts.get(e, {})
        ]
        extra = sorted(set(experts) - set(range(num_experts)))
        if missing or extra:
            raise ValueError(
                f"per-expert weights under {prefix!r} do not match {num_experts} experts: "
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, extra experts {extra}"
            )
        mats = [experts[e] for e in range(num_experts)]
        for e, m in enumerate(mats):
            for proj in projs:
                check_fp8_pair(f"{prefix}{e}.{proj}.weight", m[proj], m.get(proj + SCALE_SUFFIX))
        fp8 = {is_float8(m[proj]) for m in mats for proj in projs}
        if fp8 == {True, False}:
            raise ValueError(f"per-expert weights under {prefix!r} mix float8 and 16-bit tensors")
        if fp8 == {True}:
            out.update(stack_per_expert_fp8(prefix, mats, block))
            continue
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
    weight_block_size: tuple[int, int] = BLOCK_SIZE,
) -> dict[str, torch.Tensor]:
    """Rewrite every MoE expert entry of an HF checkpoint into `*experts.gate_up_proj` /
    `*experts.down_proj` in our layout; other entries pass through unchanged. Block-FP8
    entries (e4m3 weights with `weight_scale_inv`, or stacked ones with `*_proj_scale_inv`,
    in `weight_block_size` blocks) come out as e4m3 stacks plus `*_proj_scale_inv`."""
    wants = {
        "gate_up_proj": (num_experts, 2 * intermediate_size, hidden_size),
        "down_proj": (num_experts, hidden_size, intermediate_size),
    }
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    stacked_weights: dict[str, tuple[str, torch.Tensor]] = {}
    stacked_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        per_expert = _PER_EXPERT.match(name)
        stacked = _STACKED.match(name)
        if per_expert and per_expert["proj"] in ("gate_proj", "up_proj", "down_proj"):
            expert = groups.setdefault(per_expert["prefix"], {})
            key = per_expert["proj"] + (SCALE_SUFFIX if per_expert["scale"] else "")
            expert.setdefault(int(per_expert["idx"]), {})[key] = tensor
        elif stacked and stacked["scale"]:
            stacked_scales[name] = tensor
        elif stacked:
            stacked_weights[name] = (stacked["proj"], tensor)
        else:
            out[name] = tensor
    for name, (proj, tensor) in stacked_weights.items():
        scale = stacked_scales.pop(name + SCALE_SUFFIX, None)
        check_fp8_pair(name, tensor, scale)
        out[name] = _orient(name, tensor, wants[proj])
        if scale is not None:
            transposed = tuple(tensor.shape) != wants[proj]
            out[name + SCALE_SUFFIX] = stacked_scale_fp8(
                name, out[name], scale, transposed, intermediate_size, weight_block_size
            )
    if stacked_scales:
        raise ValueError(f"expert scales without their e4m3 weights: {sorted(stacked_scales)}")
    stacked_names = _stack_per_expert(groups, num_experts, weight_block_size)
    clash = sorted(set(stacked_names) & set(out))
    if clash:
        raise ValueError(f"checkpoint has both per-expert and stacked weights for {clash}")
    out.update(stacked_names)
    return out


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
