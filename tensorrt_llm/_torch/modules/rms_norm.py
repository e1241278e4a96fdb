"""RMSNorm computed in float32, with an optional fused residual add."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import nn

from .fp8_linear import Fp8Activation, UnscaledOutput, padded_rows
from .triton_kernels.rms_norm import rms_norm, rms_norm_quant_fp8

if TYPE_CHECKING:
    from .linear import Linear


class RMSNorm(nn.Module):
    """`y = weight * (x / sqrt(mean(x^2) + eps))`, the statistics taken in float32.

    With `residual`, the input is `x + residual` and the sum is returned as the new residual,
    which lets the decoder layer express the pre-norm residual chain in one call. On CUDA the
    add and the norm run as one Triton kernel (`triton_kernels/rms_norm.py`); elsewhere its
    torch reference runs (the same math as before the kernel). Also serves per-head norms:
    `x: [T, H, D]` with `hidden_size == D`. Subclasses with `zero_centered` scale by
    `1 + weight` instead (Qwen3.5), with the weight starting at zero.
    """

    zero_centered: ClassVar[bool] = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm hidden_size must be positive, got {hidden_size}")
        self.hidden_size = hidden_size
        self.eps = eps
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm expects last dim {self.hidden_size}, got {x.shape[-1]}")
        # The torch path casts back before the weight multiply (HF rounding in bf16).
        return rms_norm(x, self.weight, self.eps, residual, zero_centered=self.zero_centered)

    def forward_for(
        self,
        reader: Linear | None,
        x: torch.Tensor | UnscaledOutput,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """The pre-norm step of a decoder layer: `(norm(x [+ residual]), new residual)`, the
        residual being `x` itself when none is given.

        `x` may be an FP8 GEMM output still to be scaled (`UnscaledOutput`): the kernel scales
        it on load. When `reader`, the Linear that reads the output, takes FP8 rows at this
        size, the output comes as e4m3 rows from the same launch (`rms_norm_quant_fp8`)
        instead of a 16-bit tensor that the linear would quantise in a second launch.
        """
        x_scales = None
        if isinstance(x, UnscaledOutput):
            if residual is None:  # the residual must be the scaled output itself
                x = x.scaled()
            else:
                x, x_scales = x.value, (x.row_scale, x.col_scale)
        if reader is not None and reader.takes_fp8_groups(x):
            rows, group = x.shape[0], cast(tuple[int, int], reader.fp8_block)[1]
            q, scale, new_res = rms_norm_quant_fp8(
                x, self.weight, self.eps, residual, self.zero_centered, padded_rows(rows),
                x_scales=x_scales, group=group,
            )  # fmt: skip
            act = Fp8Activation(q, scale, rows, x.dtype, group)
            return act, x if new_res is None else new_res
        if reader is not None and reader.takes_fp8_rows(x):
            rows = x.shape[0]
            q, scale, new_res = rms_norm_quant_fp8(
                x, self.weight, self.eps, residual, self.zero_centered, padded_rows(rows),
                x_scales=x_scales,
            )  # fmt: skip
            return Fp8Activation(q, scale, rows, x.dtype), x if new_res is None else new_res
        if residual is None:
            return self(x), x
        return rms_norm(x, self.weight, self.eps, residual, self.zero_centered, x_scales=x_scales)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
