"""cuBLASLt's block-scaled FP8 GEMM (`torch._scaled_mm` with 1 x 128 activation scales and
128 x 128 weight scales, CUDA 12.9+ on compute capability 9.0), the other CUDA path of
`fp8_block.block_fp8_gemm` next to the Triton kernel.

Its layout rules (checked by torch): activation scales `[M, K/128]` stored M-major (what
`per_token_group_quant_fp8(..., m_major=True)` writes), weight scales `[N/128, K/128]`
contiguous, K and N multiples of 16, and no fast accumulation.
"""

from __future__ import annotations

import os
from functools import cache

import torch

_BLOCK = 128


@cache
def _device_ok(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "cuBLASLt block scaling is used on compute capability 9.0 only"
    cuda = torch.version.cuda or "0.0"
    major, minor = (int(p) for p in cuda.split(".")[:2])
    if (major, minor) < (12, 9):
        return f"needs CUDA 12.9+, torch was built with {cuda}"
    return None


def cublas_unsupported(
    device: torch.device, cols: int, depth: int, block: tuple[int, int]
) -> str | None:
    """Why cuBLASLt cannot run this block GEMM (None when it can)."""
    if block != (_BLOCK, _BLOCK):
        return f"weight blocks {block} (cuBLASLt takes 128 x 128)"
    if cols % 16 or depth % 16:
        return f"N {cols} and K {depth} must be multiples of 16"
    return _device_ok(device)


def is_m_major(x_scale: torch.Tensor) -> bool:
    """Whether activation scales `[M, G]` are stored M-major (as cuBLASLt reads them)."""
    rows, groups = x_scale.shape
    return (rows <= 1 or x_scale.stride(0) == 1) and (groups <= 1 or x_scale.stride(1) == rows)


def cublas_block_fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(xq * x_scale) @ (wq * w_scale_inv)^T (+ bias)` on cuBLASLt; `x_scale` M-major and
    the rows a multiple of 16 (`per_token_group_quant_fp8(rows_out=)` pads them)."""
    if xq.shape[0] % 16:
        raise ValueError(f"cublas_block_fp8_gemm: {xq.shape[0]} rows, pad to a multiple of 16")
    if not is_m_major(x_scale):
        raise ValueError("cublas_block_fp8_gemm: x_scale must be M-major (m_major=True)")
    return torch._scaled_mm(
        xq,
        wq.t(),
        scale_a=x_scale,
        scale_b=w_scale_inv.t(),
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=False,
    )


# TRTLLM_FP8_BLOCK_GEMM picks the CUDA implementation of the block-FP8 linears: "auto" (the
# measured choice below), "triton" (our kernel everywhere) or "cublas" (an error where it
# cannot run, never a silent switch).
GEMM_CHOICES = ("auto", "triton", "cublas")
# "auto" takes cuBLASLt from this many rows up: at 64 rows and fewer (decode) the Triton
# kernel with split-K streams the weights faster, from 128 rows cuBLASLt's Hopper kernels win,
# twice as fast at prefill sizes (benchmarks/results/fp8_block_gemm_h200.md).
CUBLAS_MIN_ROWS = 65


def requested_gemm() -> str:
    """The validated value of TRTLLM_FP8_BLOCK_GEMM ("auto" when unset)."""
    value = os.environ.get("TRTLLM_FP8_BLOCK_GEMM", "auto").strip().lower() or "auto"
    if value not in GEMM_CHOICES:
        raise ValueError(f"TRTLLM_FP8_BLOCK_GEMM={value!r}: expected one of {GEMM_CHOICES}")
    return value


def choose_block_gemm(
    device: torch.device, rows: int, cols: int, depth: int, block: tuple[int, int]
) -> str:
    """ "cublas" or "triton" for a CUDA block GEMM of `rows` x `depth` by `cols` x `depth`."""
    wanted = requested_gemm()
    if wanted == "triton":
        return "triton"
    why_not = cublas_unsupported(device, cols, depth, block)
    if wanted == "cublas":
        if why_not is not None:
            raise ValueError(f"TRTLLM_FP8_BLOCK_GEMM=cublas cannot run this GEMM: {why_not}")
        return "cublas"
    return "cublas" if why_not is None and rows >= CUBLAS_MIN_ROWS else "triton"
