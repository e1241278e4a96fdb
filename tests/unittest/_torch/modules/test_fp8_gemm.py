"""The decode-size FP8-weight GEMM kernel against an exact dequantised reference.

CPU runs use TRITON_INTERPRET=1 at tiny sizes; the GPU-marked test uses Qwen3-VL-8B layer shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tensorrt_llm._torch.modules.fp8_linear import quantize_fp8_rows  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels import HAS_TRITON  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels.fp8_gemm import (  # noqa: E402
    GemmTiles,
    choose_splits,
    fp8_gemm,
    supports,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    wq, scale = quantize_fp8_rows(w)
    return wq.to(_DEVICE), scale.view(-1).to(_DEVICE)


def _reference(a, a_scale, wq, w_scale) -> torch.Tensor:
    a32 = a.float() * (a_scale if a_scale is not None else 1.0)
    return a32 @ (wq.float() * w_scale.view(-1, 1)).t()


# (rows, N, K, forced splits): ragged rows, a last split shorter than the others (K = 5
# tiles over 2 splits), one split, and more column tiles than one.
_CASES = [(3, 40, 64, None), (17, 24, 160, 2), (1, 16, 96, 1), (5, 33, 128, 3)]


@pytest.mark.parametrize("rows,n,k,splits", _CASES)
@pytest.mark.parametrize("a_fp8", [True, False], ids=["w8a8", "w8a16"])
def test_fp8_gemm_matches_dequantised_reference(rows, n, k, splits, a_fp8) -> None:
    wq, w_scale = _weights(n, k, seed=rows + n)
    a = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(_DEVICE)
    a_scale = None
    if a_fp8:
        a, a_scale = quantize_fp8_rows(a)
    else:  # exactly representable in bf16 on both paths
        a = a.to(torch.bfloat16).float()
    got = fp8_gemm(a, wq, w_scale, a_scale, out_dtype=torch.float32, num_splits=splits)
    want = _reference(a, a_scale, wq, w_scale)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_split_count_fills_the_gpu_but_keeps_splits_long() -> None:
    assert choose_splits(1, 384, 4096, 256) == 1  # gate_up: enough column tiles already
    assert choose_splits(1, 64, 4096, 256) == 4  # o_proj: 64 tiles x 4 splits ~ 2 waves
    assert choose_splits(1, 64, 1024, 256) == 1  # too short to split
    assert choose_splits(1, 1, 1 << 20, 128) == 16  # capped
    assert supports(128, 4096) and not supports(129, 4096) and not supports(4, 100)


def test_bad_inputs_raise() -> None:
    wq, w_scale = _weights(16, 64, 0)
    a = torch.randn(2, 64, device=_DEVICE)
    with pytest.raises(ValueError, match="a_scale is required"):
        fp8_gemm(a.to(torch.float8_e4m3fn), wq, w_scale)
    with pytest.raises(ValueError, match="bad weight"):
        fp8_gemm(torch.randn(2, 32, device=_DEVICE), wq, w_scale)
    with pytest.raises(ValueError, match="multiple of block_k"):
        fp8_gemm(a, wq, w_scale, tiles=GemmTiles(16, 16, 128, 1, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32, 77, 128])
@pytest.mark.parametrize("a_fp8", [True, False], ids=["w8a8", "w8a16"])
def test_gpu_qwen3_vl_8b_shapes(rows: int, a_fp8: bool) -> None:
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        wq, w_scale = _weights(n, k, seed=n + k)
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        a_scale = None
        if a_fp8:
            a, a_scale = quantize_fp8_rows(a)
        got = fp8_gemm(a, wq, w_scale, a_scale)
        want = _reference(a, a_scale, wq, w_scale)
        assert got.dtype == torch.bfloat16
        # bf16 output rounding plus fp32 accumulation order.
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
