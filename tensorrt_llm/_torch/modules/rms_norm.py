"""RMSNorm computed in float32, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from .triton_kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """`y = weight * (x / sqrt(mean(x^2) + eps))`, the statistics taken in float32.

    With `residual`, the input is `x + residual` and the sum is returned as the new residual,
    which lets the decoder layer express the pre-norm residual chain in one call. On CUDA the
    add and the norm run as one Triton kernel (`triton_kernels/rms_norm.py`); elsewhere its
    torch reference runs (the same math as before the kernel). Also serves per-head norms:
    `x: [T, H, D]` with `hidden_size == D`.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm hidden_size must be positive, got {hidden_size}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm expects last dim {self.hidden_size}, got {x.shape[-1]}")
        # The torch path casts back before the weight multiply (HF rounding in bf16).
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
