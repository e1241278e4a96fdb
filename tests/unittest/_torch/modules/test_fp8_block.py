"""Block-FP8 Triton kernels (group quantization, block-scaled GEMM, linear) against the torch
references of `fp8_block.py`: on the CPU through Triton's interpreter at odd shapes, on the GPU
(`gpu` marker) bit-exact quantization and Qwen3-VL-8B's projection sizes.

NOTE: the interpreter rounds fp32 -> e4m3 wrongly (it drops the carry into the exponent:
124.3 -> 64), so on the CPU the quantization kernel is compared bit for bit only on inputs
whose e4m3 values are exact, and the GEMM is fed the torch quantizer's bytes."""

from __future__ import annotations

import itertools

import pytest
import torch

from tensorrt_llm._torch.modules.triton_kernels import HAS_TRITON
from tensorrt_llm._torch.modules.triton_kernels import fp8_block as fb
from tensorrt_llm._torch.modules.triton_kernels import fp8_block_gemm as fbg

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 accumulation in a different order over K tiles (and split-K partials): relative to
# the output's largest value. The references multiply the same e4m3 bytes and scales.
GEMM_RTOL = 1e-5
# On the GPU: Hopper's FP8 tensor-core MMA accumulates a K block with fewer mantissa bits than
# fp32 (the block scales are applied in fp32 after each 128-wide block), measured 1.4e-4 of the
# output's largest value for the qkv projection at 64 rows.
GPU_GEMM_RTOL = 1e-3


def _exact_e4m3_input(rows: int, cols: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Values whose group amax is 448 * 2^-4, every value e4m3-representable after scaling."""
    gen = torch.Generator().manual_seed(rows * 7 + cols)
    q = (torch.randn(rows, cols, generator=gen) * 100).clamp(-448, 448)
    q = q.to(fb.FP8_DTYPE).float()
    q[:, ::group] = 448.0  # each group's amax
    return (q / 16).to(dtype)


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,cols,group", [(1, 300, 128), (3, 128, 128), (17, 200, 64)])
def test_group_quant_bytes_match_reference(
    dtype: torch.dtype, rows: int, cols: int, group: int
) -> None:
    x = _exact_e4m3_input(rows, cols, group, dtype).to(DEV)
    x[0, :group] = 0  # an all-zero group takes the 1e-12 floor
    q, s = fb.per_token_group_quant_fp8(x, group, backend="triton")
    ref_q, ref_s = fb.per_token_group_quant_fp8_torch(x, group)
    assert q.dtype == fb.FP8_DTYPE and s.shape == (rows, -(-cols // group))
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_group_quant_scales_on_random_input() -> None:
    x = (torch.randn(5, 333) * 3).to(torch.bfloat16).to(DEV)
    _, s = fb.per_token_group_quant_fp8(x, 128, backend="triton")
    assert torch.equal(s, fb.per_token_group_quant_fp8_torch(x, 128)[1])


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize(
    "cols,depth,block", [(200, 300, (128, 128)), (200, 300, (1, 128)), (72, 4096, (128, 128))]
)
def test_block_gemm_matches_reference(rows: int, cols: int, depth: int, block) -> None:
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, depth, generator=gen).to(torch.bfloat16)
    w = torch.randn(cols, depth, generator=gen) * 0.05
    wq, ws = fb.quantize_weight_fp8_block(w, block)
    xq, xs = fb.per_token_group_quant_fp8_torch(x, block[1])
    bias = torch.randn(cols, generator=gen)
    args = [t.to(DEV) for t in (xq, xs, wq, ws)]
    want = fb.block_fp8_gemm_torch(*args, torch.float32, block) + bias.to(DEV)
    got = fb.block_fp8_gemm(*args, torch.float32, block, backend="triton", bias=bias.to(DEV))
    assert got.shape == (rows, cols) and got.dtype == torch.float32
    assert _max_rel(got, want) < GEMM_RTOL
    half = fb.block_fp8_gemm(*args, torch.bfloat16, block, backend="triton")
    assert half.dtype == torch.bfloat16
    assert _max_rel(half, want - bias.to(DEV)) < 1e-2  # one bf16 rounding


def test_split_k_plan_fills_the_sms_at_decode_sizes() -> None:
    # Qwen3-VL-8B's down projection (N 4096, K 12288) at batch 1: 64 output tiles on 132 SMs.
    tiles = fbg.gemm_tiles(1)
    splits, per_split = fbg.split_k_plan(tiles, 4096, 96, 132)
    assert splits * 64 >= 132 and splits * per_split >= 96 > (splits - 1) * per_split
    # Prefill buckets never split; every M of a bucket gets the same plan (one variant).
    assert fbg.split_k_plan(fbg.gemm_tiles(4096), 4096, 96, 132) == (1, 96)
    assert {fbg.split_k_plan(fbg.gemm_tiles(m), 200, 3, 132) for m in range(65, 129)} == {(3, 1)}


def test_group_quant_m_major_scales() -> None:
    x = (torch.randn(5, 333) * 3).to(torch.bfloat16).to(DEV)
    _, s = fb.per_token_group_quant_fp8(x, 128, backend="triton", m_major=True)
    _, ref = fb.per_token_group_quant_fp8(x, 128, backend="torch", m_major=True)
    assert s.shape == ref.shape == (5, 3) and s.stride() == ref.stride() == (1, 5)
    assert torch.equal(s, fb.per_token_group_quant_fp8_torch(x, 128)[1]) and torch.equal(s, ref)


@pytest.mark.parametrize("m_major", [False, True])
def test_explicit_tiles_grouped_rows_and_splits(m_major: bool) -> None:
    # 3 row tiles of 16 walked in groups of 2 (a partial last group), 7 column tiles, K split
    # in 2 (3 K tiles: 2 + 1), and the scales in either layout.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 300, generator=gen).to(torch.bfloat16)
    wq, ws = fb.quantize_weight_fp8_block(torch.randn(200, 300, generator=gen) * 0.05)
    xq, xs = fb.per_token_group_quant_fp8_torch(x, 128)
    want = fb.block_fp8_gemm_torch(xq, xs, wq, ws, torch.float32)
    if m_major:
        xs = xs.t().contiguous().t()
    xq, xs, wq, ws = (t.to(DEV) for t in (xq, xs, wq, ws))
    grouped = fbg.GemmTiles(64, 16, 32, 4, 2, True, group_m=2)
    swapped = fbg.GemmTiles(64, 16, 64, 4, 2, True, swap_ab=True)  # 3 token tiles of 16
    for tiles, splits in itertools.product((grouped, swapped), (1, 2)):
        got = fbg.triton_block_fp8_gemm(
            xq, xs, wq, ws, torch.float32, (128, 128), None, tiles, splits
        )
        assert _max_rel(got, want.to(DEV)) < GEMM_RTOL


def test_fixed_split_leaves_no_split_empty() -> None:
    assert fbg.fixed_split(3, 2) == (2, 2)
    assert fbg.fixed_split(96, 16) == (16, 6)
    assert fbg.fixed_split(5, 4) == (3, 2)  # 4 splits of 2 would leave the last one empty
    assert fbg.fixed_split(2, 8) == (2, 1)


def test_linear_matches_torch_path_and_checks_shapes() -> None:
    gen = torch.Generator().manual_seed(1)
    x = _exact_e4m3_input(6, 300, 128, torch.bfloat16).view(2, 3, 300).to(DEV)
    wq, ws = fb.quantize_weight_fp8_block(torch.randn(200, 300, generator=gen) * 0.05)
    bias = torch.randn(200, generator=gen).to(torch.bfloat16).to(DEV)
    wq, ws = wq.to(DEV), ws.to(DEV)
    got = fb.fp8_block_linear(x, wq, ws, bias, backend="triton")
    want = fb.fp8_block_linear_torch(x, wq, ws, bias)
    assert got.shape == (2, 3, 200) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        fb.block_fp8_gemm(wq[:6], ws[:, :3], wq, ws[:1], torch.bfloat16, backend="triton")
    with pytest.raises(ValueError, match="x_scale has shape"):
        fb.block_fp8_gemm(wq[:6], ws[:1], wq, ws, torch.bfloat16, backend="triton")
    with pytest.raises(ValueError, match="power of two"):
        xq, xs = fb.per_token_group_quant_fp8_torch(x.reshape(6, 300), 100)
        fb.block_fp8_gemm(xq, xs, wq, ws[:, :1].repeat(1, 3), torch.bfloat16, (128, 100), "triton")


# Qwen3-VL-8B's text projections: (N, K) of qkv, o, gate_up, down.
_QWEN3_VL_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64, 256, 1024])
@pytest.mark.parametrize("cols,depth", _QWEN3_VL_8B)
def test_gpu_real_sizes(rows: int, cols: int, depth: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
    wq, ws = fb.quantize_weight_fp8_block(torch.randn(cols, depth, device="cuda") * 0.02)
    q, s = fb.per_token_group_quant_fp8(x, 128, backend="triton")
    ref_q, ref_s = fb.per_token_group_quant_fp8_torch(x, 128)
    assert torch.equal(s, ref_s) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    want = fb.block_fp8_gemm_torch(ref_q, ref_s, wq, ws, torch.float32)
    got = fb.block_fp8_gemm(q, s, wq, ws, torch.float32, backend="triton")
    assert _max_rel(got, want) < GPU_GEMM_RTOL
    out = fb.fp8_block_linear(x, wq, ws)  # "auto": Triton on CUDA
    assert _max_rel(out, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 1024])
@pytest.mark.parametrize("cols,depth", _QWEN3_VL_8B)
def test_gpu_cublas_block_gemm(rows: int, cols: int, depth: int) -> None:
    from tensorrt_llm._torch.modules.fp8_block_cublas import cublas_block_fp8_gemm

    torch.manual_seed(0)
    x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
    wq, ws = fb.quantize_weight_fp8_block(torch.randn(cols, depth, device="cuda") * 0.02)
    pad = rows + (-rows) % 16  # cuBLASLt takes multiples of 16 rows
    q, s = fb.per_token_group_quant_fp8(x, 128, m_major=True, rows_out=pad)
    want = fb.block_fp8_gemm_torch(q[:rows], s[:rows], wq, ws, torch.float32)
    got = cublas_block_fp8_gemm(q, s, wq, ws, torch.bfloat16)[:rows]
    assert got.shape == (rows, cols) and _max_rel(got, want) < 1e-2  # one bf16 rounding
