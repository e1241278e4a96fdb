"""SwiGLU MLP with one fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`.

    `gate_up_proj` holds HF's `gate_proj` rows first, then `up_proj` (see
    `models/weight_loading.py` FUSED_PROJECTIONS), so one matmul serves both.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(
            hidden_size,
            2 * intermediate_size,
            bias=bias,
            dtype=dtype,
            output_splits=(intermediate_size, intermediate_size),
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
