"""Which CUDA implementation runs a block-FP8 linear (`fp8_block_cublas.choose_block_gemm`):
TRTLLM_FP8_BLOCK_GEMM is validated, and asking for cuBLASLt where it cannot run is an error
that says why, never a silent switch to Triton."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.modules import fp8_block_cublas as fc

CPU = torch.device("cpu")


def test_unset_and_explicit_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRTLLM_FP8_BLOCK_GEMM", raising=False)
    assert fc.requested_gemm() == "auto"
    assert fc.choose_block_gemm(CPU, 4096, 4096, 4096, (128, 128)) == "triton"
    monkeypatch.setenv("TRTLLM_FP8_BLOCK_GEMM", " Triton ")
    assert fc.choose_block_gemm(CPU, 1, 4096, 4096, (128, 128)) == "triton"


def test_bad_value_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTLLM_FP8_BLOCK_GEMM", "cutlass")
    with pytest.raises(ValueError, match=r"'cutlass'.*auto.*triton.*cublas"):
        fc.choose_block_gemm(CPU, 1, 4096, 4096, (128, 128))


def test_forced_cublas_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTLLM_FP8_BLOCK_GEMM", "cublas")
    with pytest.raises(ValueError, match="not a CUDA device"):
        fc.choose_block_gemm(CPU, 1, 4096, 4096, (128, 128))
    with pytest.raises(ValueError, match="weight blocks"):
        fc.choose_block_gemm(CPU, 1, 4096, 4096, (1, 128))
    with pytest.raises(ValueError, match="multiples of 16"):
        fc.choose_block_gemm(CPU, 1, 200, 4096, (128, 128))


def test_m_major_layout_check() -> None:
    s = torch.zeros(5, 3)
    assert not fc.is_m_major(s) and fc.is_m_major(s.t().contiguous().t())
    assert fc.is_m_major(torch.zeros(1, 3)) and fc.is_m_major(torch.zeros(5, 1))
    wide = torch.zeros(16, 3)
    with pytest.raises(ValueError, match="M-major"):
        fc.cublas_block_fp8_gemm(
            torch.zeros(16, 256), wide, torch.zeros(128, 256), s, torch.float32
        )
    with pytest.raises(ValueError, match="multiple of 16"):
        fc.cublas_block_fp8_gemm(torch.zeros(5, 256), s, torch.zeros(128, 256), s, torch.float32)


@pytest.mark.gpu
def test_gpu_forced_cublas_linear_matches_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorrt_llm._torch.modules.fp8_block_linear import fp8_block_forward
    from tensorrt_llm._torch.modules.triton_kernels import fp8_block as fb

    torch.manual_seed(0)
    x = torch.randn(3, 16, 4096, device="cuda", dtype=torch.bfloat16)
    wq, ws = fb.quantize_weight_fp8_block(torch.randn(6144, 4096, device="cuda") * 0.02)
    bias = torch.randn(6144, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("TRTLLM_FP8_BLOCK_GEMM", "triton")
    want = fp8_block_forward(x, wq, ws, bias, (128, 128))
    monkeypatch.setenv("TRTLLM_FP8_BLOCK_GEMM", "cublas")
    got = fp8_block_forward(x, wq, ws, bias, (128, 128))
    assert got.shape == want.shape == (3, 16, 6144)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
