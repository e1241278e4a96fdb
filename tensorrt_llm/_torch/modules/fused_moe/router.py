"""Top-k softmax routing, as Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE and Qwen3-Next route."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..triton_kernels.moe_routing import Layout, moe_route, route_ref

# 8 bf16 output columns = 16-byte rows of the logits, which cuBLAS's fast kernels need.
ROW_ALIGN = 8


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), then the top-k; optionally rescale the k to sum to 1.

    router_logits: [T, num_experts]. Returns (topk_weights [T, k] in the logits' dtype,
    topk_ids [T, k] int64), best expert first. With `renormalize` this equals a softmax over
    the top-k logits (TensorRT-LLM's "Renormalize" routing); without it, "Default" routing.
    """
    return route_ref(router_logits, top_k, renormalize)


class TopKRouter(nn.Module):
    """The MoE gate: `logits = x @ weight^T` (weight [num_experts, hidden], HF's `mlp.gate`).

    With a fused shared expert (`shared_fusion.py`) the weight has one more row, the shared
    expert's gate, and every token gets a (k + 1)-th pair `(num_experts, sigmoid(logit))`.
    The weight's rows are then padded with zeros to a multiple of `ROW_ALIGN`: with E + 1 = 257
    output columns cuBLAS picks a slow unaligned kernel on the H200 (8192 rows: 161 us against
    16 us at 264 columns, `benchmarks/bench_moe.py`); the padding logits are never read.
    """

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
        self.shared_expert = False
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))

    @property
    def num_logits(self) -> int:
        """The logit columns routing reads: the experts, plus the shared expert's gate."""
        return self.num_experts + int(self.shared_expert)

    def append_shared_gate_(self, gate_weight: torch.Tensor) -> None:
        """Make `gate_weight` ([1, hidden]) row E of the router, then pad the rows with zeros
        to a multiple of ROW_ALIGN (see the class docstring)."""
        if self.shared_expert:
            raise RuntimeError("the router already holds a shared expert's gate")
        rows = torch.cat([self.weight, gate_weight.to(self.weight.dtype)])
        pad = -rows.shape[0] % ROW_ALIGN
        self.weight = nn.Parameter(F.pad(rows, (0, 0, 0, pad)), requires_grad=False)
        self.shared_expert = True

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, num_logits]: a view past the padding columns."""
        return F.linear(hidden_states, self.weight)[:, : self.num_logits]

    def route(
        self, hidden_states: torch.Tensor, block_m: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Layout | None]:
        """[T, hidden] -> (weights [T, k (+1)], ids [T, k (+1)], the expert layout aligned to
        `block_m` or None); one Triton routing kernel (+ one alignment) on CUDA."""
        logits = self.logits(hidden_states)
        return moe_route(logits, self.top_k, self.renormalize, self.shared_expert, block_m)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> (topk_weights [T, k (+1)], topk_ids [T, k (+1)])."""
        weights, ids, _ = self.route(hidden_states)
        return weights, ids

    def extra_repr(self) -> str:
        shared = ", shared_expert=True" if self.shared_expert else ""
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"renormalize={self.renormalize}{shared}")  # fmt: skip
