"""FP8 (e4m3) weight-and-activation linear layers: per-channel weight scales, per-token dynamic
activation scales, `torch._scaled_mm` on CUDA and an exact-dequantize torch path elsewhere.

Used by `quantization="fp8"`: after the weights are loaded, `quantize_model_fp8_` converts the
text decoder's widening `Linear` layers (qkv, gate_up) in place. The vision tower, the LM head
and the narrowing projections (o, down) stay in 16 bits, where they are faster.
"""

from __future__ import annotations

import torch
from torch import nn

from .triton_kernels.fp8_quant import FP8_MAX, quantize_rows

FP8_DTYPE = torch.float8_e4m3fn
_MIN_SCALE = 1e-12


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of `x: [M, K]` to e4m3 with its own scale; returns (xq, scale [M, 1])."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_(min=_MIN_SCALE)
    xq = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ dequant(weight)^T + bias` with `weight: [N, K]` e4m3 and `weight_scale: [N]` fp32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    if x.is_cuda:
        # Row count padded to 16 for cuBLASLt; one fused Triton kernel quantises and pads.
        xq, x_scale = quantize_rows(x2, rows_out=rows + (-rows) % 16)
        out = torch._scaled_mm(
            xq,
            weight.t(),
            scale_a=x_scale,
            scale_b=weight_scale.view(1, -1),
            out_dtype=x.dtype,
            use_fast_accum=True,
        )[:rows]
    else:
        xq, x_scale = quantize_fp8_rows(x2)
        deq_w = weight.float() * weight_scale.view(-1, 1)
        out = ((xq.float() * x_scale) @ deq_w.t()).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


@torch.no_grad()
def quantize_linear_fp8_(linear: nn.Module) -> None:
    """Replace `linear.weight` by its e4m3 form plus a per-output-channel `weight_scale`."""
    weight = linear.weight.data
    if weight.dtype == FP8_DTYPE:
        return
    wq, scale = quantize_fp8_rows(weight)
    linear.weight = nn.Parameter(wq, requires_grad=False)
    linear.register_buffer("weight_scale", scale.view(-1).contiguous(), persistent=False)


def quantize_model_fp8_(
    model: nn.Module, skip: tuple[str, ...] = ("visual",), widening_only: bool = False
) -> int:
    """Convert every project `Linear` outside the `skip` sub-modules; returns how many.

    `widening_only` converts only layers with more outputs than inputs (qkv, gate_up, the
    DeltaNet input projections) and keeps the narrowing ones (o_proj, down_proj, out_proj)
    in 16 bits. At decode batch sizes the row-wise-scaled FP8 GEMM is slower than bf16 on a
    narrow output: on the H200, Qwen3-VL-8B o_proj 13.4 vs 11.1 us and down_proj 32.7 vs
    30.2 us, while gate_up drops from 50 to 33 us (benchmarks/results/fp8_gemm_h200.md).
    """
    from .linear import Linear

    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or any(part in skip for part in name.split(".")):
            continue
        if widening_only and module.out_features <= module.in_features:
            continue
        quantize_linear_fp8_(module)
        count += 1
    return count
