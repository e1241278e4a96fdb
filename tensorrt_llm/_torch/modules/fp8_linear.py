"""FP8 (e4m3) weight-and-activation linear layers: per-channel weight scales, per-token dynamic
activation scales, `torch._scaled_mm` on CUDA and an exact-dequantize torch path elsewhere.

Used by `quantization="fp8"`: after the weights are loaded, `linear.quantize_model_fp8_`
converts the text decoder's `Linear` layers in place. The vision tower and the LM head stay
in 16 bits.

Tensor parallelism: a weight scale is its full output row's, on every rank. A column-parallel
shard holds whole rows; a row-parallel one (input features split) holds a column slice of each
row, so its per-row amax is all-reduced (MAX) over the ranks first and every rank's scales,
and e4m3 values, are the TP=1 layer's slices bit for bit. The per-token activation scales stay
each rank's own: a row-parallel layer's input is a column slice too, and making its scales the
full row's would take a collective per layer per step, more than the few-ulp difference it
removes (the partial products differ from one GPU's by rounding, within tolerance, not bits).

At decode row counts (up to `_TENSORWISE_MAX_ROWS`) the GEMM runs with unit scalar scales,
which selects cuBLASLt's tensor-wise kernels (about twice the bandwidth of its row-wise ones
there), and `scale_outer_` applies the row and channel scales afterwards. Larger row counts
are compute-bound and take the row-wise-scaled GEMM directly.

Two hand-offs save launches on that path: a producer may give a linear its input already
quantised (`Fp8Activation`, written by the preceding RMSNorm), and a linear may give its reader
its output before scaling (`UnscaledOutput`, scaled on load by the following add+RMSNorm or by
the SwiGLU kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .triton_kernels.fp8_quant import FP8_MAX, quantize_rows
from .triton_kernels.fp8_scale import scale_outer_

FP8_DTYPE = torch.float8_e4m3fn
_MIN_SCALE = 1e-12
_TENSORWISE_MAX_ROWS = 256
_unit_scales: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A persistent fp32 scalar 1 per device (graph captures keep pointing at it)."""
    one = _unit_scales.get(device)
    if one is None:
        one = _unit_scales[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 `[M, 1]`: the largest magnitude of each row of `x: [M, K]`."""
    return x.abs().amax(dim=-1, keepdim=True).float()


def quantize_fp8_rows(
    x: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of `x: [M, K]` to e4m3 with its own scale; returns (xq, scale [M, 1]).
    `amax` `[M, 1]`: the rows' amax when `x` is a column slice of longer rows (a row-parallel
    weight shard), so the scale is the whole row's; `row_amax(x)` otherwise."""
    if amax is None:
        amax = row_amax(x)
    scale = (amax / FP8_MAX).clamp_(min=_MIN_SCALE)
    xq = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


@dataclass
class Fp8Activation:
    """Activations already quantised for an FP8 linear by their producer, in its own launch
    (`rms_norm_quant_fp8`, `silu_and_mul_group_quant`): e4m3 rows padded to a multiple of 16
    and their fp32 scales; the first `rows` are real. `dtype` is what the linear returns.

    `group == 0`: per-row scales `[rows_out, 1]` for a per-channel FP8 linear. `group > 0`:
    per 1 x `group` column scales `[rows_out, ceil(K / group)]`, M-major, for a block-FP8
    linear with that `bk`."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype
    group: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        """`[rows, K]`, like the tensor it replaces (the attention module reads row counts)."""
        return (self.rows, self.q.shape[1])


@dataclass
class UnscaledOutput:
    """An FP8 GEMM output before its scales: the layer's output is
    `value[m, n] * row_scale[m] * col_scale[n]`. A reader that scales on load (the next
    residual add + RMSNorm, `RMSNorm.forward_for`) saves the separate rescale launch."""

    value: torch.Tensor  # [M, N], the activation dtype
    row_scale: torch.Tensor  # fp32 [>= M, 1]
    col_scale: torch.Tensor  # fp32 [N]

    def scaled(self) -> torch.Tensor:
        """The output itself (`scale_outer_` in place on `value`)."""
        return scale_outer_(self.value, self.row_scale, self.col_scale)


def padded_rows(rows: int) -> int:
    """cuBLASLt's FP8 GEMMs want a multiple of 16 rows."""
    return rows + (-rows) % 16


def uses_tensorwise_gemm(x: torch.Tensor) -> bool:
    """Whether `fp8_linear(x, ...)` runs the unit-scale GEMM and rescales afterwards.

    bf16 only: the unscaled products reach 448 * 448 * K, past fp16's range.
    """
    rows = x.numel() // x.shape[-1]
    return x.is_cuda and x.dtype == torch.bfloat16 and rows <= _TENSORWISE_MAX_ROWS


def fp8_gemm_unscaled(
    x2: torch.Tensor | Fp8Activation, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x2: [M, K]` quantised per row (or already, as an `Fp8Activation`), times the e4m3
    `weight: [N, K]`, with no scale applied.

    Returns (the product in the activation dtype `[M, N]`, the fp32 row scales `[>= M, 1]`);
    the caller applies `row scale * weight_scale` (`scale_outer_`, or a consumer kernel).
    """
    if isinstance(x2, Fp8Activation):
        xq, x_scale, rows, dtype = x2.q, x2.scale, x2.rows, x2.dtype
    elif x2.is_cuda:
        # One fused Triton kernel quantises and pads.
        rows, dtype = x2.shape[0], x2.dtype
        xq, x_scale = quantize_rows(x2, rows_out=padded_rows(rows))
    else:  # CPU: the same arithmetic, for tests of the wiring
        xq, x_scale = quantize_fp8_rows(x2)
        return (xq.float() @ weight.float().t()).to(x2.dtype), x_scale
    if not xq.is_cuda:
        return (xq[:rows].float() @ weight.float().t()).to(dtype), x_scale
    one = _unit_scale(xq.device)
    out = torch._scaled_mm(
        xq, weight.t(), scale_a=one, scale_b=one, out_dtype=dtype, use_fast_accum=True
    )
    return out[:rows], x_scale


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`x @ dequant(weight)^T + bias` with `weight: [N, K]` e4m3 and `weight_scale: [N]` fp32."""
    if isinstance(x, Fp8Activation):
        out, x_scale = fp8_gemm_unscaled(x, weight)
        return scale_outer_(out, x_scale, weight_scale, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    if uses_tensorwise_gemm(x):
        out, x_scale = fp8_gemm_unscaled(x2, weight)
        out = scale_outer_(out, x_scale, weight_scale, bias)
        return out.reshape(*shape[:-1], weight.shape[0])
    if x.is_cuda:
        xq, x_scale = quantize_rows(x2, rows_out=padded_rows(rows))
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
def quantize_linear_fp8_(linear: nn.Module, amax: torch.Tensor | None = None) -> None:
    """Replace `linear.weight` by its e4m3 form plus a per-output-channel `weight_scale`
    (from `amax` `[N, 1]` when given: see `quantize_fp8_rows`)."""
    weight = linear.weight.data
    if weight.dtype == FP8_DTYPE:
        return
    wq, scale = quantize_fp8_rows(weight, amax)
    linear.weight = nn.Parameter(wq, requires_grad=False)
    linear.register_buffer("weight_scale", scale.view(-1).contiguous(), persistent=False)
