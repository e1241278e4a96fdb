"""Triton attention on an fp8 (e4m3) KV cache: parity with vanilla reading the same stored
values, the fp16-products and experimental e4m3 q @ k^T decode paths, saturating stores.

On CPU the kernels run under TRITON_INTERPRET=1 at tiny sizes; GPU-marked tests use Qwen3-VL
attention sizes in bf16.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton_pair_helpers import Pair as _Pair  # noqa: E402

from tensorrt_llm._torch.attention_backend.triton_kernels import (  # noqa: E402
    decode as decode_kernels,
)
from tensorrt_llm._torch.attention_backend.triton_kernels import store_kv  # noqa: E402


def _fp8_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(x.dtype)


@pytest.fixture(params=[False, True], ids=["dot-in-q-dtype", "fp16-dot"])
def fp16_dot(request, monkeypatch) -> bool:
    """Run a test with the decode kernel's fp8-cache products forced to q's dtype or fp16."""
    real = decode_kernels._tile_config

    def forced(*args):
        return dataclasses.replace(real(*args), fp16_dot=request.param)

    monkeypatch.setattr(decode_kernels, "_tile_config", forced)
    return request.param


def test_fp8_cache_matches_vanilla_and_stays_near_full_precision(fp16_dot: bool) -> None:
    """An e4m3 cache: Triton and vanilla read the same stored values (tight match), and the
    result stays within fp8 rounding of a full-precision cache.

    K/V are fp8-representable here because the Triton interpreter's float conversions do not
    round like the GPU's (or torch's); the GPU test below stores unrounded values."""
    fp8 = _Pair(4, 2, splits=2, cache_dtype=torch.float8_e4m3fn)
    full = _Pair(4, 2, splits=2)
    assert fp8.tri_cache.get_buffers(0).dtype == torch.float8_e4m3fn
    # fp16 products round q and p to 11 bits (fp32 q here): ~1e-3 instead of exact.
    tight = 3e-3 if fp16_dot else 1e-4
    for step in (([(0, 19, 0), (1, 6, 0)], []), ([], [(0, 19), (1, 6)])):
        got, md = fp8.step(*step, atol=tight, kv_round=_fp8_round)
        want, _ = full.step(*step)
        n = md.num_tokens
        # e4m3 keeps 3 mantissa bits: ~6% per element, averaged down by the softmax.
        torch.testing.assert_close(got[:n], want[:n], atol=0.15, rtol=0.15)
        assert (got[:n] - want[:n]).abs().max() > 0  # really quantised


def _fp8_decode_output(monkeypatch, **tiles: bool) -> torch.Tensor:
    """Prefill then one decode step on an fp8 cache with the given `DecodeTiles` options;
    checks the decode against vanilla (within `atol` 0.08: q's e4m3 rounding at most)."""
    real = decode_kernels._tile_config
    monkeypatch.setattr(
        decode_kernels, "_tile_config", lambda *a: dataclasses.replace(real(*a), **tiles)
    )
    pair = _Pair(4, 2, splits=2, cache_dtype=torch.float8_e4m3fn)
    pair.step([(0, 19, 0), (1, 6, 0)], [], atol=1e-4, kv_round=_fp8_round)
    got, md = pair.step([], [(0, 19), (1, 6)], atol=0.08, kv_round=_fp8_round)
    return got[: md.num_tokens]


def test_fp8_qk_products_stay_close_to_the_fp8_cache_reference(monkeypatch) -> None:
    """The experimental e4m3 q @ k^T (`DecodeTiles.qk_fp8`): q is quantised per head, so the
    result moves by about e4m3's rounding of q (3 mantissa bits) from the fp16-products path
    it shares p @ v with, and no further than that from vanilla."""
    fp16 = _fp8_decode_output(monkeypatch, fp16_dot=True)
    qk8 = _fp8_decode_output(monkeypatch, qk_fp8=True)
    diff = (qk8 - fp16).abs().max()
    assert 3e-3 < diff < 0.08, diff  # fp16 q rounds at ~5e-4; e4m3 q at ~6%


@pytest.mark.gpu
def test_gpu_fp8_cache_matches_vanilla_bf16(fp16_dot: bool) -> None:
    pair = _Pair(32, 8, head_dim=128, blocks=64, tpb=32, dtype=torch.bfloat16, device="cuda",
                 cache_dtype=torch.float8_e4m3fn)  # fmt: skip
    pair.step([(0, 300, 0), (1, 45, 0)], [], atol=2e-2)
    pair.step([(1, 70, 45)], [(0, 300)], atol=2e-2)
    for i in range(3):
        pair.step([], [(0, 301 + i), (1, 115 + i)], atol=2e-2)


@pytest.mark.gpu
def test_gpu_fp8_qk_products_match_vanilla_bf16(monkeypatch) -> None:
    real = decode_kernels._tile_config
    monkeypatch.setattr(
        decode_kernels, "_tile_config", lambda *a: dataclasses.replace(real(*a), qk_fp8=True)
    )
    pair = _Pair(32, 8, head_dim=128, blocks=64, tpb=32, dtype=torch.bfloat16, device="cuda",
                 cache_dtype=torch.float8_e4m3fn)  # fmt: skip
    pair.step([(0, 300, 0), (1, 45, 0)], [], atol=2e-2)
    for i in range(3):  # q's e4m3 rounding: looser than the fp16-products path
        pair.step([], [(0, 300 + i), (1, 45 + i)], atol=0.08)


@pytest.mark.parametrize("store", ["triton", "vanilla"])
def test_fp8_cache_store_saturates_instead_of_nan(store: str) -> None:
    from tensorrt_llm._torch.attention_backend.vanilla import store_kv as vanilla_store

    cache = torch.zeros(2, 2, 4, 1, 16, dtype=torch.float8_e4m3fn)
    k = torch.tensor([1000.0, -1000.0, 1.0, 0.3])[:, None, None].expand(4, 1, 16).contiguous()
    (store_kv if store == "triton" else vanilla_store)(cache, k, -k, torch.arange(4))
    stored = cache[0].float()
    assert not stored.isnan().any()
    assert stored[0, :, 0, 0].tolist() == [448.0, -448.0, 1.0, 0.3125]
    assert stored[1, :, 0, 0].tolist() == [-448.0, 448.0, -1.0, -0.3125]
