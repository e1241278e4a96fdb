"""HF checkpoint expert entries -> `MoEExperts`' stacked layout (`convert_hf_expert_weights`).

Accepted: transformers 5.x stacks (`experts.gate_up_proj: [E, 2*I, H]`, gate rows first, and
`experts.down_proj: [E, H, I]`), the hub's per-expert `experts.N.{gate,up,down}_proj.weight`
and Qwen3-VL-MoE's transposed stacks (`[E, H, 2*I]`, `[E, I, H]`). Block-FP8 entries (e4m3
with their `weight_scale_inv`) come out as e4m3 stacks plus `*_proj_scale_inv`
(`fp8_experts.py` has the layout).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..triton_kernels.fp8_block import BLOCK_SIZE
from .fp8_experts import (
    SCALE_SUFFIX,
    check_fp8_pair,
    is_float8,
    stack_per_expert_fp8,
    stacked_scale_fp8,
)

_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts\.)(?P<idx>\d+)\.(?P<proj>\w+)\.weight(?P<scale>_scale_inv)?$"
)
_STACKED = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts\.)(?P<proj>gate_up_proj|down_proj)(?P<scale>_scale_inv)?$"
)


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
