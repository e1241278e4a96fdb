"""SwiGLU MLP with one fused gate_up projection."""

from __future__ import annotations

import torch
from torch import nn

from .fp8_linear import Fp8Activation, UnscaledOutput
from .linear import Linear
from .triton_kernels.activation import silu_and_mul


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`.

    `gate_up_proj` holds HF's `gate_proj` rows first, then `up_proj` (see
    `models/weight_loading.py` FUSED_PROJECTIONS), so one matmul serves both, and the
    activation reads that layout directly (one Triton kernel on CUDA, chunk+silu+mul elsewhere).
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

    def forward(
        self, x: torch.Tensor | Fp8Activation, defer_output_scale: bool = False
    ) -> torch.Tensor | UnscaledOutput:
        """With `defer_output_scale`, an FP8 down_proj may return its output unscaled
        (`Linear.forward_deferred`) for the next norm to scale on load."""
        unscaled = self.gate_up_proj.forward_unscaled(x)  # FP8 at decode sizes only
        if unscaled is None:
            act = silu_and_mul(self.gate_up_proj(x))
        else:
            gate_up, row_scale, col_scale = unscaled
            act = silu_and_mul(gate_up, row_scale=row_scale, col_scale=col_scale)
        return self.down_proj.forward_deferred(act) if defer_output_scale else self.down_proj(act)
