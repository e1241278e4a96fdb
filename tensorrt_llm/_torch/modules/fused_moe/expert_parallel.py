"""Expert parallelism: the routed experts split over the ranks of the tp group.

Every rank holds `num_experts / moe_ep_size` consecutive experts. Attention ends in an
all-reduce, so every rank has the same tokens: each routes them itself (replicated router
weights, the same top-k everywhere), runs only the (token, expert) pairs that land on its own
experts, and one all-reduce sums the ranks' partial outputs (the combine). No token moves
before the experts: the all-gather dispatch of upstream's EP is already done by the reduce.

Weights: a rank reads only its experts (`select_local_experts`, before the stacked layout is
built), renumbered from 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ....mapping import Mapping as ParallelMapping
from ...distributed import TensorShard

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
    """Routing onto this rank's experts: pairs routed elsewhere get weight 0 on local expert
    0 (their product adds nothing), so the expert kernel's shapes stay those of the step."""
    local = topk_ids - start
    elsewhere = (local < 0) | (local >= count)
    return local.masked_fill(elsewhere, 0), topk_weights.masked_fill(elsewhere, 0.0)


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
