"""SwiGLU MLP with one fused gate_up projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...mapping import Mapping
from .fp8_linear import Fp8Activation, UnscaledOutput, padded_rows
from .linear import Linear
from .tensor_parallel import TensorParallelMode
from .triton_kernels.activation import silu_and_mul, silu_and_mul_group_quant

if TYPE_CHECKING:
    from .rms_norm import RMSNorm


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`.

    `gate_up_proj` holds HF's `gate_proj` rows first, then `up_proj` (see
    `_torch/weight_loading.py` FUSED_PROJECTIONS), so one matmul serves both, and the
    activation reads that layout directly (one Triton kernel on CUDA, chunk+silu+mul elsewhere).
    Tensor parallelism: gate_up is column-parallel (gate and up split alike, so each rank's
    rows still read [gate | up]) and down_proj row-parallel: one all-reduce.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        mapping: Mapping | None = None,
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
            mapping=mapping,
            tensor_parallel_mode=TensorParallelMode.COLUMN,
        )
        self.down_proj = Linear(
            intermediate_size,
            hidden_size,
            bias=bias,
            dtype=dtype,
            mapping=mapping,
            tensor_parallel_mode=TensorParallelMode.ROW,
        )

    def forward(
        self, x: torch.Tensor | Fp8Activation, defer_output_scale: bool = False
    ) -> torch.Tensor | UnscaledOutput:
        """With `defer_output_scale`, an FP8 down_proj may return its output unscaled
        (`Linear.forward_deferred`) for the next norm to scale on load."""
        act = self._activation(x)
        return self.down_proj.forward_deferred(act) if defer_output_scale else self.down_proj(act)

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel: this rank's partial output before down_proj's all-reduce, for a
        caller that folds it into another reduce (`MoE`: the routed experts' one)."""
        return self.down_proj.forward_partial(self._activation(x))

    def _activation(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor | Fp8Activation:
        """`silu(gate) * up`, quantised for a block-FP8 down_proj when it takes groups."""
        unscaled = self.gate_up_proj.forward_unscaled(x)  # FP8 at decode sizes only
        act: torch.Tensor | Fp8Activation
        if unscaled is None:
            gate_up = self.gate_up_proj(x)
            block = self.down_proj.fp8_block
            if block is not None and self.down_proj.takes_fp8_groups(gate_up):
                # Block-FP8 down_proj: the activation comes quantised from the same launch.
                rows = gate_up.shape[0]
                q, scale = silu_and_mul_group_quant(gate_up, block[1], padded_rows(rows))
                act = Fp8Activation(q, scale, rows, gate_up.dtype, block[1])
            else:
                act = silu_and_mul(gate_up)
        else:
            gate_up, row_scale, col_scale = unscaled
            act = silu_and_mul(gate_up, row_scale=row_scale, col_scale=col_scale)
        return act


def mlp_after_norm(
    norm: RMSNorm,
    mlp: nn.Module,
    hidden_states: torch.Tensor | UnscaledOutput,
    residual: torch.Tensor,
) -> tuple[torch.Tensor | UnscaledOutput, torch.Tensor]:
    """The second half of a pre-norm decoder layer: `(mlp(norm(x + residual)), new residual)`.

    A dense `GatedMLP` takes the FP8 hand-offs: e4m3 rows from the norm into gate_up, and
    down_proj's output left unscaled for the next norm. Other MLPs (MoE) get 16-bit tensors.
    """
    dense = isinstance(mlp, GatedMLP)
    hidden_states, residual = norm.forward_for(
        mlp.gate_up_proj if dense else None, hidden_states, residual
    )
    if dense:
        return mlp(hidden_states, defer_output_scale=True), residual
    return mlp(hidden_states), residual
