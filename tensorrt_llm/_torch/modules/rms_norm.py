"""RMSNorm computed in float32, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`y = weight * (x / sqrt(mean(x^2) + eps))`, the statistics taken in float32.

    With `residual`, the input is `x + residual` and the sum is returned as the new residual,
    which lets the decoder layer express the pre-norm residual chain in one call.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm hidden_size must be positive, got {hidden_size}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        # Cast back before the weight multiply, matching the HF reference rounding in bf16.
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm expects last dim {self.hidden_size}, got {x.shape[-1]}")
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
