"""FP8 linear layers: quantisation error bounds, model conversion, end-to-end generation."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.modules.fp8_linear import (
    FP8_DTYPE,
    fp8_linear,
    quantize_fp8_rows,
)
from tensorrt_llm._torch.modules.linear import Linear, quantize_model_fp8_
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_row_quantisation_round_trips_within_e4m3_precision() -> None:
    x = torch.randn(7, 64) * torch.logspace(-2, 2, 7).unsqueeze(1)  # rows of very different size
    xq, scale = quantize_fp8_rows(x)
    assert xq.dtype == FP8_DTYPE and scale.shape == (7, 1)
    back = xq.float() * scale
    assert _relative_error(back, x) < 0.04  # e4m3 has a 3-bit mantissa
    assert back.abs().amax(dim=1).sub(x.abs().amax(dim=1)).abs().max() < 1e-4  # max is exact


def test_fp8_linear_close_to_full_precision() -> None:
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias, std=0.05)
    x = torch.randn(3, 5, 64)
    ref = F.linear(x, layer.weight, layer.bias)
    quantize_model_fp8_(torch.nn.Sequential(layer))
    assert layer.weight.dtype == FP8_DTYPE
    out = layer(x)
    assert out.shape == ref.shape
    assert _relative_error(out, ref) < 0.06


def test_conversion_skips_the_vision_tower() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.visual = torch.nn.Module()
            self.visual.proj = Linear(16, 16)
            self.llm = Linear(16, 32)

    model = Model()
    for p in model.parameters():
        torch.nn.init.normal_(p)
    assert quantize_model_fp8_(model) == 1
    assert model.llm.weight.dtype == FP8_DTYPE
    assert model.visual.proj.weight.dtype == torch.float32


def test_llm_with_fp8_generates_like_full_precision() -> None:
    ckpt = str(get_or_build_demo_checkpoint())
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # inproc: the test reads the engine's weights.
    with LLM(model=ckpt, quantization="fp8", executor_mode="inproc") as llm:
        model = llm._executor.model_engine.model
        assert model.llm.lm_head.weight.dtype == torch.float32
        dtypes = {
            name.rsplit(".", 2)[-2]: p.dtype
            for name, p in model.llm.named_parameters()
            if name.endswith("proj.weight")
        }
        assert dtypes["gate_up_proj"] == FP8_DTYPE and dtypes["down_proj"] == FP8_DTYPE
        out = llm.generate("hello there", params).outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=ckpt, quantization="int3")


def test_row_quantisation_kernel_writes_its_own_padding_rows(monkeypatch) -> None:
    """The Triton kernel (interpreter on CPU) fills the padding rows itself (zeros, scale 1)
    instead of the caller launching fill kernels: buffers come from `torch.empty`, here
    poisoned with 7s, and every row must still come out right. Only scales and padding are
    compared: the interpreter does not round e4m3 like the GPU."""
    from tensorrt_llm._torch.modules.triton_kernels import HAS_TRITON, fp8_quant

    if not HAS_TRITON or (not torch.cuda.is_available() and not _interpreting()):
        pytest.skip("needs triton (interpreter on CPU)")
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(7.0))
    x = torch.randn(5, 48) * torch.tensor([0.01, 1.0, 10.0, 100.0, 0.0]).unsqueeze(1)
    q, s = fp8_quant.quantize_rows(x, rows_out=16, backend="triton")
    monkeypatch.undo()
    _, ref_s = quantize_fp8_rows(x)
    assert q.shape == (16, 48) and s.shape == (16, 1)
    torch.testing.assert_close(s[:5], ref_s)
    assert torch.all(q[5:].float() == 0) and torch.all(s[5:] == 1)


@pytest.mark.gpu
def test_scaled_mm_matches_dequantised_reference() -> None:
    torch.manual_seed(0)
    w = torch.randn(256, 512) * 0.05
    wq, w_scale = quantize_fp8_rows(w)
    for rows in (1, 5, 32, 100):
        x = torch.randn(rows, 512)
        cpu = fp8_linear(x, wq, w_scale.view(-1), None)
        gpu = fp8_linear(x.cuda().bfloat16(), wq.cuda(), w_scale.view(-1).cuda(), None)
        assert _relative_error(gpu.float().cpu(), cpu) < 0.02


@pytest.mark.gpu
def test_triton_row_quantisation_matches_torch() -> None:
    # GPU only: Triton's interpreter does not reproduce e4m3 rounding on the CPU.
    from tensorrt_llm._torch.modules.triton_kernels.fp8_quant import quantize_rows

    scales = torch.tensor([0.01, 1.0, 10.0, 100.0, 0.0]).unsqueeze(1)
    x = (torch.randn(5, 48) * scales).cuda().bfloat16()
    ref_q, ref_s = quantize_fp8_rows(x)
    q, s = quantize_rows(x, rows_out=16, backend="triton")
    assert q.shape == (16, 48) and s.shape == (16, 1)
    torch.testing.assert_close(s[:5], ref_s)
    torch.testing.assert_close(q[:5].float() * s[:5], ref_q.float() * ref_s, rtol=0.07, atol=0)
    assert torch.all(q[5:].float() == 0) and torch.all(s[5:] == 1)
