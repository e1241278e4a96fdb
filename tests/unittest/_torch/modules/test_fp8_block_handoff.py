"""Block-FP8 activations quantised by their producers (`Fp8Activation` with `group`): the
RMSNorm and SwiGLU kernels write e4m3 groups and M-major scales that equal
`per_token_group_quant_fp8` of their 16-bit output, padding rows included, and a block-FP8
Linear gives from them what it gives from the 16-bit tensor.

NOTE: Triton's interpreter rounds fp32 -> e4m3 wrongly (test_fp8_block.py) and bf16 not quite
as the GPU does, so the fused kernels are compared with the separate kernels on the same
backend (bit for bit), and the torch paths with the torch references. On the GPU the group
quantisation kernel itself equals the torch reference (test_fp8_block.py)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.modules.fp8_block_cublas import CUBLAS_MIN_ROWS
from tensorrt_llm._torch.modules.fp8_linear import Fp8Activation
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP
from tensorrt_llm._torch.modules.linear import Linear
from tensorrt_llm._torch.modules.triton_kernels import HAS_TRITON
from tensorrt_llm._torch.modules.triton_kernels import fp8_block as fb
from tensorrt_llm._torch.modules.triton_kernels.activation import (
    silu_and_mul,
    silu_and_mul_group_quant,
    silu_and_mul_torch,
)
from tensorrt_llm._torch.modules.triton_kernels.rms_norm import (
    rms_norm,
    rms_norm_quant_fp8,
    rms_norm_torch,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(
    q: torch.Tensor, scale: torch.Tensor, ref: torch.Tensor, rows_out: int, backend: str
) -> None:
    """q / scale against `per_token_group_quant_fp8(ref)` padded to rows_out rows, the
    separate quantisation on the same backend (the interpreter's e4m3 rounding on the CPU)."""
    rows, cols = ref.shape
    ref_q, ref_s = fb.per_token_group_quant_fp8(ref, 128, backend)
    assert q.shape == (rows_out, cols) and q.dtype == fb.FP8_DTYPE
    assert scale.shape == (rows_out, -(-cols // 128)) and scale.stride() == (1, rows_out)
    assert torch.equal(scale[:rows], ref_s)
    assert torch.equal(q[:rows].view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.all(scale[rows:] == 1) and torch.all(q[rows:].view(torch.uint8) == 0)


@pytest.mark.parametrize("cols", [256, 300])
@pytest.mark.parametrize("with_residual,zero_centered", [(False, False), (True, True)])
def test_rms_norm_group_quant(cols: int, with_residual: bool, zero_centered: bool) -> None:
    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(5, cols, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    w = torch.randn(cols, generator=gen).to(torch.bfloat16).to(DEV)
    res = torch.randn(5, cols, generator=gen).to(torch.bfloat16).to(DEV) if with_residual else None
    q, scale, new_res = rms_norm_quant_fp8(
        x, w, 1e-6, res, zero_centered, rows_out=16, backend="triton", group=128
    )
    # Fused equals separate: the group quantisation of the norm kernel's own 16-bit output
    # (under the interpreter that output differs from torch's by a bf16 step here and there).
    normed = rms_norm(x, w, 1e-6, res, zero_centered, backend="triton")
    ref, ref_res = normed if with_residual else (normed, None)
    _check(q, scale, ref, 16, "triton")
    if with_residual:
        assert torch.equal(new_res, ref_res)
    q_t, s_t, _ = rms_norm_quant_fp8(x, w, 1e-6, res, zero_centered, 16, "torch", group=128)
    torch_ref = rms_norm_torch(x, w, 1e-6, res, zero_centered)
    _check(q_t, s_t, torch_ref[0] if with_residual else torch_ref, 16, "torch")


def test_rms_norm_group_must_fit_the_row_block() -> None:
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm_quant_fp8(x, torch.ones(64), 1e-6, group=128)


@pytest.mark.parametrize("inter", [512, 640])
def test_silu_and_mul_group_quant(inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(3, 2 * inter, generator=gen) * 2).to(torch.bfloat16).to(DEV)
    q, scale = silu_and_mul_group_quant(gate_up, 128, rows_out=16, backend="triton")
    _check(q, scale, silu_and_mul(gate_up, backend="triton"), 16, "triton")  # fused = separate
    q_t, s_t = silu_and_mul_group_quant(gate_up, 128, rows_out=16, backend="torch")
    _check(q_t, s_t, silu_and_mul_torch(gate_up), 16, "torch")
    with pytest.raises(ValueError, match="rows_out"):
        silu_and_mul_group_quant(gate_up, 128, rows_out=2)


def _block_linear(n: int, k: int, gen: torch.Generator) -> Linear:
    lin = Linear(k, n, bias=True, dtype=torch.bfloat16)
    lin.to_fp8_block_((128, 128), quantize_on_load=True)
    lin.load_fp8_block_shards("w", [torch.randn(n, k, generator=gen) * 0.05], None)
    with torch.no_grad():
        lin.bias.copy_(torch.randn(n, generator=gen))
    return lin


def test_block_linear_takes_quantised_groups() -> None:
    gen = torch.Generator().manual_seed(2)
    lin = _block_linear(200, 300, gen)
    x = torch.randn(5, 300, generator=gen).to(torch.bfloat16)
    q, scale = fb.per_token_group_quant_fp8(x, 128, m_major=True, rows_out=16)
    got = lin(Fp8Activation(q, scale, 5, torch.bfloat16, group=128))
    assert got.shape == (5, 200)
    torch.testing.assert_close(got, lin(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="groups of 64"):
        lin(Fp8Activation(q, scale, 5, torch.bfloat16, group=64))
    with pytest.raises(TypeError, match="groups of a row"):
        lin(Fp8Activation(q, scale[:, :1], 5, torch.bfloat16))
    plain = Linear(300, 200, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="not block-FP8"):
        plain(Fp8Activation(q, scale, 5, torch.bfloat16, group=128))
    assert not lin.takes_fp8_groups(x)  # producers hand over groups on CUDA only


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [3, 32, 200])
def test_gpu_block_mlp_handoff_matches_unfused(rows: int) -> None:
    """GatedMLP with block-FP8 layers: SwiGLU writes the down projection's groups where its
    GEMM is cuBLASLt's (from 65 rows), and either way gives the unfused path's output."""
    gen = torch.Generator().manual_seed(rows)
    mlp = GatedMLP(4096, 12288, dtype=torch.bfloat16)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.to_fp8_block_((128, 128), quantize_on_load=True)
        shards = [torch.randn(s, lin.in_features, generator=gen) * 0.02 for s in lin.output_splits]
        lin.load_fp8_block_shards("w", shards, None)
    mlp = mlp.cuda()
    x = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16).cuda()
    # Groups are handed over only to cuBLASLt (from 65 rows): the Triton decode GEMM reads
    # 16-bit rows and quantises them itself (faster at batch 1, level at 32).
    assert mlp.down_proj.takes_fp8_groups(x) == (rows >= CUBLAS_MIN_ROWS)
    got = mlp(x)
    act = silu_and_mul_torch(mlp.gate_up_proj(x))
    want = fb.fp8_block_linear_torch(act, mlp.down_proj.weight, mlp.down_proj.weight_scale_inv)
    rel = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert got.shape == (rows, 4096) and rel < 1e-2
