"""Top-k softmax routing, as Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE and Qwen3-Next route."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), then the top-k; optionally rescale the k to sum to 1.

    router_logits: [T, num_experts]. Returns (topk_weights [T, k] in the logits' dtype,
    topk_ids [T, k] int64), best expert first. With `renormalize` this equals a softmax over
    the top-k logits (TensorRT-LLM's "Renormalize" routing); without it, "Default" routing.
    """
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # The cast matches HF, which scales the expert outputs by weights in the model dtype.
    return weights.to(router_logits.dtype), ids


class TopKRouter(nn.Module):
    """The MoE gate: `logits = x @ weight^T` (weight [num_experts, hidden], HF's `mlp.gate`)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> (topk_weights [T, k], topk_ids [T, k] int64)."""
        logits = F.linear(hidden_states, self.weight)
        return softmax_topk(logits, self.top_k, self.renormalize)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}"
