"""The FP8 tensor-wise GEMM path: unit-scale GEMM, then the row/channel scales applied by
`scale_outer_` or, for gate_up, by the SwiGLU kernel on load.

Without CUDA the kernels run under TRITON_INTERPRET=1 in fp32 (the interpreter does not round
bf16 like the GPU); the wiring through `Linear.forward_unscaled` and `GatedMLP` is checked on
the CPU by forcing the tensor-wise path; `gpu` tests compare against the row-wise GEMM.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Must precede the first triton import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tensorrt_llm._torch.modules import linear as linear_module  # noqa: E402
from tensorrt_llm._torch.modules.fp8_linear import (  # noqa: E402
    FP8_DTYPE,
    fp8_linear,
    quantize_fp8_rows,
)
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP  # noqa: E402
from tensorrt_llm._torch.modules.linear import Linear, quantize_model_fp8_  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels import HAS_TRITON  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels.activation import (  # noqa: E402
    silu_and_mul,
    silu_and_mul_torch,
)
from tensorrt_llm._torch.modules.triton_kernels.fp8_quant import quantize_rows  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels.fp8_scale import (  # noqa: E402
    scale_outer_,
    scale_outer_torch,
)
from tensorrt_llm._torch.modules.triton_kernels.rms_norm import (  # noqa: E402
    rms_norm,
    rms_norm_quant_fp8,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_triton
@pytest.mark.parametrize("with_bias", [False, True])
def test_scale_outer_kernel_matches_torch(with_bias: bool) -> None:
    torch.manual_seed(0)
    wide = torch.randn(5, 1500, device=DEVICE)  # 1500 columns: two blocks, the second partial
    out = wide[:, :1300]  # row stride 1500: a row-sliced GEMM output
    a = torch.rand(8, 1, device=DEVICE) + 0.1  # padded row scales: only the first 5 are used
    b = torch.rand(1300, device=DEVICE) + 0.1
    bias = torch.randn(1300, device=DEVICE) if with_bias else None
    before = out.clone()
    expected = before * a[:5] * b + (bias if with_bias else 0.0)
    untouched = wide[:, 1300:].clone()
    got = scale_outer_(out, a, b, bias, backend="triton")
    assert got.data_ptr() == out.data_ptr()  # in place
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(wide[:, 1300:], untouched)  # nothing past the view's columns
    torch.testing.assert_close(scale_outer_torch(before, a[:5], b, bias), expected)


def test_scale_outer_rejects_mismatched_scales() -> None:
    out = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="row scales"):
        scale_outer_(out, torch.ones(3), torch.ones(6))
    with pytest.raises(ValueError, match="row scales"):
        scale_outer_(out, torch.ones(4), torch.ones(5))
    with pytest.raises(ValueError, match="unit column stride"):
        scale_outer_(out.t(), torch.ones(6), torch.ones(4))


@needs_triton
def test_scaled_silu_and_mul_kernel_scales_on_load() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(3, 2, 40, device=DEVICE) * 3.0  # I = 20; 6 rows
    row_scale = torch.rand(16, 1, device=DEVICE) + 0.5  # padded to 16 like fp8_gemm_unscaled's
    col_scale = torch.rand(40, device=DEVICE) + 0.5
    expected = silu_and_mul_torch(gate_up * row_scale[:6].view(3, 2, 1) * col_scale)
    got = silu_and_mul(gate_up, backend="triton", row_scale=row_scale, col_scale=col_scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        silu_and_mul(gate_up, backend="torch", row_scale=row_scale, col_scale=col_scale),
        expected,
        rtol=1e-5,
        atol=1e-5,
    )
    # Without scales the kernel is the plain SwiGLU, so the scales really change the result.
    assert _relative_error(silu_and_mul(gate_up, backend="triton"), expected) > 0.1


def test_scaled_silu_and_mul_rejects_half_the_scales() -> None:
    gate_up = torch.randn(4, 8)
    with pytest.raises(ValueError, match="go together"):
        silu_and_mul(gate_up, row_scale=torch.ones(4))
    with pytest.raises(ValueError, match="column scales"):
        silu_and_mul(gate_up, row_scale=torch.ones(4), col_scale=torch.ones(4))


@needs_triton
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_norm_quant_kernel_matches_norm_then_quantise(
    with_residual: bool, zero_centered: bool
) -> None:
    """One launch (interpreter on CPU) gives the scales of `quantize_rows(rms_norm(...))`
    exactly, e4m3 values that dequantise to the norm output, the new residual, and zeroed
    padding rows. The e4m3 bits are compared on the GPU only (the interpreter rounds e4m3
    differently)."""
    torch.manual_seed(0)
    x = torch.randn(5, 48, device=DEVICE) * torch.tensor([0.01, 1, 10, 100, 3.0]).view(5, 1)
    w = torch.randn(48, device=DEVICE)
    res = torch.randn(5, 48, device=DEVICE) if with_residual else None
    q, scale, new_res = rms_norm_quant_fp8(
        x, w, 1e-6, res, zero_centered=zero_centered, rows_out=16, backend="triton"
    )
    normed = rms_norm(x, w, 1e-6, res, zero_centered=zero_centered, backend="torch")
    ref_out, ref_res = normed if with_residual else (normed, None)
    ref_q, ref_scale = quantize_rows(ref_out, rows_out=16, backend="torch")
    assert q.shape == (16, 48) and q.dtype == FP8_DTYPE and scale.shape == (16, 1)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    back = q[:5].float() * scale[:5]
    assert _relative_error(back, ref_out) < 0.07  # e4m3: 3 mantissa bits
    # +0 bytes (the GEMM ignores padding rows, but fused and separate paths must agree)
    assert torch.all(q[5:].view(torch.uint8) == 0) and torch.all(scale[5:] == 1)
    if with_residual:
        torch.testing.assert_close(new_res, ref_res)
    else:
        assert new_res is None
    # The torch path gives the reference itself.
    q_t, s_t, _ = rms_norm_quant_fp8(x, w, 1e-6, res, zero_centered, 16, backend="torch")
    assert torch.equal(q_t.float(), ref_q.float()) and torch.equal(s_t, ref_scale)


@needs_triton
@pytest.mark.parametrize("quant", [False, True])
def test_norm_scales_an_unscaled_gemm_output_on_load(quant: bool) -> None:
    """`x_scales`: the kernel (interpreter on CPU) reads an unscaled FP8 GEMM output and its
    row/column scales and gives what `scale_outer_` then the norm give: the same new residual
    and output (or e4m3 rows and scales)."""
    torch.manual_seed(0)
    x = torch.randn(6, 40, device=DEVICE)
    res = torch.randn(6, 40, device=DEVICE)
    w = torch.randn(40, device=DEVICE)
    row_scale = torch.rand(16, 1, device=DEVICE) + 0.5  # padded like fp8_gemm_unscaled's
    col_scale = torch.rand(40, device=DEVICE) + 0.5
    scaled = scale_outer_torch(x.clone(), row_scale[:6], col_scale, None)
    ref_out, ref_res = rms_norm(scaled, w, 1e-6, res, backend="torch")
    if quant:
        q, s, new_res = rms_norm_quant_fp8(
            x, w, 1e-6, res, rows_out=16, backend="triton", x_scales=(row_scale, col_scale)
        )
        ref_q, ref_s = quantize_rows(ref_out, rows_out=16, backend="torch")
        torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=0)
        assert _relative_error(q[:6].float() * s[:6], ref_out) < 0.07
    else:
        out, new_res = rms_norm(x, w, 1e-6, res, backend="triton", x_scales=(row_scale, col_scale))
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_res, ref_res, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="x_scales"):
        rms_norm(x, w, 1e-6, res, x_scales=(row_scale[:3], col_scale))


def test_norm_quant_rejects_bad_rows() -> None:
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="rows_out 2 < rows 4"):
        rms_norm_quant_fp8(x, w, 1e-6, rows_out=2)
    with pytest.raises(ValueError, match=r"\[M, D\]"):
        rms_norm_quant_fp8(x.view(2, 2, 8), w, 1e-6)


def _fp8_mlp(dtype: torch.dtype, device: torch.device, bias: bool = False) -> GatedMLP:
    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, bias=bias, dtype=dtype).to(device)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.05)
    quantize_model_fp8_(mlp)
    assert mlp.gate_up_proj.weight.dtype == FP8_DTYPE and mlp.down_proj.weight.dtype == FP8_DTYPE
    return mlp


def test_gated_mlp_defers_gate_up_scales_to_the_activation(monkeypatch) -> None:
    """Force the tensor-wise path on the CPU: the MLP must take the unscaled gate_up output
    plus its scales and give what scaling first gives."""
    mlp = _fp8_mlp(torch.float32, torch.device("cpu"))
    x = torch.randn(7, 64)
    with torch.no_grad():
        gate_up = mlp.gate_up_proj(x)  # row-wise path (CPU default): scaled output
        expected = mlp.down_proj(silu_and_mul_torch(gate_up))
        calls = []
        real = silu_and_mul

        def spy(t: torch.Tensor, **kw):
            calls.append(kw)
            return real(t, **kw)

        monkeypatch.setattr("tensorrt_llm._torch.modules.gated_mlp.silu_and_mul", spy)
        monkeypatch.setattr(linear_module, "uses_tensorwise_gemm", lambda x: True)
        got = mlp(x)
    assert calls and calls[0].get("row_scale") is not None  # the deferred path was taken
    assert _relative_error(got, expected) < 1e-5


def test_forward_unscaled_declines_when_it_cannot_defer(monkeypatch) -> None:
    monkeypatch.setattr(linear_module, "uses_tensorwise_gemm", lambda x: True)
    x = torch.randn(3, 16)
    plain = Linear(16, 32)
    with_bias = Linear(16, 32, bias=True)
    for layer in (plain, with_bias):
        for p in layer.parameters():
            torch.nn.init.normal_(p)
    assert plain.forward_unscaled(x) is None  # not FP8
    quantize_model_fp8_(torch.nn.ModuleList([plain, with_bias]))
    assert with_bias.forward_unscaled(x) is None  # a bias must be added after scaling
    out, row_scale, col_scale = plain.forward_unscaled(x)
    torch.testing.assert_close(
        out * row_scale[:3] * col_scale, plain(x), rtol=1e-5, atol=1e-5
    )  # fmt: skip


# ---- GPU: the tensor-wise path against the row-wise GEMM at Qwen3-VL-8B sizes -----------------


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_tensorwise_matches_rowwise_gemm(with_bias: bool, monkeypatch) -> None:
    from tensorrt_llm._torch.modules import fp8_linear as fp8_module

    torch.manual_seed(0)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_fp8_rows(w)
    ws = ws.view(-1).contiguous()
    bias = torch.randn(6144, device="cuda", dtype=torch.bfloat16) if with_bias else None
    for rows in (1, 7, 32, 128):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        assert fp8_module.uses_tensorwise_gemm(x)
        tensorwise = fp8_linear(x, wq, ws, bias)
        monkeypatch.setattr(fp8_module, "_TENSORWISE_MAX_ROWS", 0)
        rowwise = fp8_linear(x, wq, ws, bias)
        monkeypatch.undo()
        # Same products and scales; only the extra bf16 rounding before scaling differs.
        assert _relative_error(tensorwise, rowwise) < 8e-3
        ref = x.float() @ (wq.float() * ws.view(-1, 1)).t() + (bias.float() if with_bias else 0)
        assert _relative_error(tensorwise, ref) < 0.03


@pytest.mark.gpu
def test_gpu_gated_mlp_fused_scales_match_separate_rescale() -> None:
    mlp = _fp8_mlp(torch.bfloat16, torch.device("cuda"))
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fused = mlp(x)
        separate = mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x)))  # scale_outer_, then SwiGLU
    # The fused kernel rounds the scaled gate/up to bf16 as scale_outer_ stores them.
    torch.testing.assert_close(fused, separate, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_every_family_generates_the_same_with_the_tensorwise_path(
    family: str, tmp_path, monkeypatch
) -> None:
    """`quantization="fp8"` on the CPU, with the tensor-wise path forced on for every FP8
    linear (dense and shared-expert MLPs, attention, DeltaNet projections): the unscaled GEMM
    plus the deferred scales, and the norms that write e4m3 rows for their readers, must give
    the greedy tokens of the row-wise path."""
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm._torch.modules import fp8_linear as fp8_module
    from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

    ckpt = str(write_tiny_checkpoint(family, tmp_path / family))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["a text-only request", "another, somewhat longer text-only request"]

    def run() -> list[list[int]]:
        # inproc: the monkeypatched kernels must be the ones the engine calls.
        with LLM(model=ckpt, quantization="fp8", max_batch_size=2, executor_mode="inproc") as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    rowwise = run()
    calls = []
    real = fp8_module.fp8_gemm_unscaled

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for module in (fp8_module, linear_module):
        monkeypatch.setattr(module, "uses_tensorwise_gemm", lambda x: True)
        monkeypatch.setattr(module, "fp8_gemm_unscaled", counting)
    from tensorrt_llm._torch.modules import rms_norm as norm_module

    fused = []
    real_norm_quant = norm_module.rms_norm_quant_fp8

    def counting_norm(*args, **kwargs):
        fused.append(1)
        return real_norm_quant(*args, **kwargs)

    monkeypatch.setattr(norm_module, "rms_norm_quant_fp8", counting_norm)
    assert run() == rowwise
    assert calls  # the forced path really ran
    assert fused  # the decoder norms handed their FP8 readers e4m3 rows


@pytest.mark.gpu
def test_gpu_norm_scaling_on_load_is_bit_exact_to_rescale_then_norm() -> None:
    """At Qwen3-VL-8B sizes in bf16, an unscaled down_proj output scaled inside the add+norm
    kernel gives the bytes of `scale_outer_` followed by the add+norm kernel."""
    torch.manual_seed(0)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    col_scale = torch.rand(4096, device="cuda") * 1e-3
    for rows in (1, 7, 32, 128):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) * 100
        res = torch.randn_like(x)
        row_scale = torch.rand(rows + (-rows) % 16, 1, device="cuda")
        out, new_res = rms_norm(x, w, 1e-6, res, x_scales=(row_scale, col_scale))
        scaled = scale_outer_(x.clone(), row_scale, col_scale)
        ref_out, ref_res = rms_norm(scaled, w, 1e-6, res)
        assert torch.equal(new_res, ref_res) and torch.equal(out, ref_out)


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_norm_quant_is_bit_exact_to_norm_then_quantise(with_residual: bool) -> None:
    """At Qwen3-VL-8B width in bf16: the fused launch writes the same e4m3 bytes and scales as
    the RMSNorm kernel followed by the row-quantisation kernel."""
    torch.manual_seed(0)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 7, 32, 128):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x) if with_residual else None
        padded = rows + (-rows) % 16
        q, scale, new_res = rms_norm_quant_fp8(x, w, 1e-6, res, rows_out=padded)
        normed = rms_norm(x, w, 1e-6, res)
        out, ref_res = normed if with_residual else (normed, None)
        ref_q, ref_scale = quantize_rows(out, rows_out=padded)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(scale, ref_scale)
        if with_residual:
            assert torch.equal(new_res, ref_res)
