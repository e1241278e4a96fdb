"""Expert parallelism: the routed experts split over the ranks of the tp group.

Every rank holds `num_experts / moe_ep_size` consecutive experts. Attention ends in an
all-reduce, so every rank has the same tokens: each routes them itself (replicated router
weights, the same top-k everywhere), runs only the (token, expert) pairs that land on its own
experts, and one all-reduce sums the ranks' partial outputs (the combine). No token moves
before the experts: the all-gather dispatch of upstream's EP is already done by the reduce.

A shared expert is tensor-parallel (column gate_up, row down_proj). Its partial output
before the row reduce joins the routed partial sum, scaled by the replicated
`sigmoid(shared_expert_gate(x))` (a per-token scalar: `s * sum_r p_r = sum_r s * p_r`), so
one all-reduce per MoE layer combines both (`combine_expert_parallel`).

Weights: a rank reads only its experts (`select_local_experts`, before the stacked layout is
built), renumbered from 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ....mapping import Mapping as ParallelMapping
from ...distributed import TensorShard, all_reduce

if TYPE_CHECKING:
    from .moe import MoE

_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?experts\.)(?P<idx>\d+)\.(?P<rest>.+)$")
_STACKED = re.compile(r"^(?:.*\.)?experts\.(?:gate_up_proj|down_proj)(?:_scale_inv)?$")


def expert_range(num_experts: int, mapping: ParallelMapping) -> tuple[int, int]:
    """(first expert, count) of this rank."""
    if mapping.moe_ep_size != mapping.tp_size:
        raise ValueError(
            f"moe_expert_parallel_size={mapping.moe_ep_size} must equal "
            f"tensor_parallel_size={mapping.tp_size} (expert tensor parallelism is not built)"
        )
    ep = mapping.moe_ep_size
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by moe_ep_size={ep}")
    count = num_experts // ep
    return (mapping.tp_rank % ep) * count, count


def local_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, start: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing onto this rank's experts, renumbered from 0: a pair routed elsewhere gets the
    dropped id `count` (and weight 0), which every `fused_moe(..., dropped=True)` path leaves
    uncomputed; the tensors keep the step's shapes (no host sync, CUDA-graph safe)."""
    local = topk_ids - start
    elsewhere = (local < 0) | (local >= count)
    return local.masked_fill(elsewhere, count), topk_weights.masked_fill(elsewhere, 0.0)


def combine_expert_parallel(
    moe: MoE, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """`moe`'s output on this rank's tokens `x [T, H]` from the global routing: the local
    experts' pairs plus the shared expert's partial sum, all-reduced once."""
    assert moe.local_experts is not None
    ids, weights = local_routing(topk_ids, topk_weights, *moe.local_experts)
    partial = moe.experts(x, ids, weights, dropped=True)
    if moe.shared_expert is not None and moe.shared_expert_gate is not None:
        gate = torch.sigmoid(moe.shared_expert_gate(x))
        partial = partial + gate * moe.shared_expert.forward_partial(x)
    return all_reduce(partial, moe.mapping)


def _materialize(value: Any) -> torch.Tensor:
    return value.materialize() if hasattr(value, "materialize") else value


def select_local_experts(
    weights: Mapping[str, Any], num_experts: int, mapping: ParallelMapping
) -> dict[str, Any]:
    """Only this rank's expert tensors, renumbered from 0 (per-expert names) or sliced along
    the expert dim (stacked ones); other entries pass through untouched."""
    start, count = expert_range(num_experts, mapping)
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        per_expert = _PER_EXPERT.match(name)
        if per_expert is not None and per_expert["rest"].endswith(("weight", "weight_scale_inv")):
            idx = int(per_expert["idx"]) - start
            if 0 <= idx < count:
                out[f"{per_expert['prefix']}{idx}.{per_expert['rest']}"] = _materialize(tensor)
        elif _STACKED.match(name):
            out[name] = TensorShard(0, start, count).take(tensor)
        else:
            out[name] = tensor
    return out
