"""The optional flash_attn backend against the vanilla reference.

flash-attn is installed on neither of this project's machines, so the CPU tests run the backend
over `fake_flash_attn` (flash-attn's documented contract in plain torch, every rule asserted);
the GPU test runs the real package where it imports and skips elsewhere.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fake_flash_attn  # noqa: E402
from triton_pair_helpers import FakeKVCacheManager, Pair, build_metadata, qkv_rows  # noqa: E402

from tensorrt_llm._torch.attention_backend import get_attention_backend  # noqa: E402
from tensorrt_llm._torch.attention_backend.flash_attn import FlashAttnAttention  # noqa: E402
from tensorrt_llm.llmapi.llm_args import LlmArgs  # noqa: E402

PAGE = 256


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn)


def _pair(heads: int, kv_heads: int, device: str = "cpu") -> Pair:
    return Pair(
        heads,
        kv_heads,
        head_dim=16,
        blocks=12,
        tpb=PAGE,
        dtype=torch.bfloat16,
        device=device,
        fast=FlashAttnAttention,
    )


def _schedule(pair: Pair, atol: float) -> None:
    # Prompts crossing a page boundary, then a chunk over a cached prefix next to decodes
    # (a mixed step), then pure decode, then decode rows padded as a CUDA graph pads them.
    pair.step([(0, 300, 0), (1, 17, 0), (2, 40, 0)], [], atol=atol)
    pair.step([(2, 230, 40)], [(0, 300), (1, 17)], atol=atol)
    pair.step([], [(0, 301), (1, 18), (2, 270)], atol=atol)
    got, md = pair.step([], [(0, 302), (1, 19), (2, 271)], pad_to=5, atol=atol)
    assert torch.all(got[md.num_tokens :] == 0)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_matches_vanilla_over_prefill_chunks_and_decode(
    stand_in: None, heads: int, kv_heads: int
) -> None:
    _schedule(_pair(heads, kv_heads), atol=2e-2)


def test_registry_builds_it_and_a_missing_package_is_a_clear_error(
    stand_in: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_attention_backend("flash_attn")(4, 2, 16, 0)
    assert isinstance(backend, FlashAttnAttention)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # the import fails
    with pytest.raises(ValueError, match="pip install flash-attn"):
        FlashAttnAttention(4, 2, 16, 0)


@pytest.mark.parametrize(
    "q_dtype,cache_dtype,page,message",
    [
        (torch.float32, torch.float32, PAGE, "runs fp16/bf16 models"),
        (torch.bfloat16, torch.float8_e4m3fn, PAGE, "no fp8 cache"),
        (torch.bfloat16, torch.bfloat16, 32, "multiple of 256"),
    ],
)
def test_rejects_what_flash_attn_cannot_read(
    stand_in: None, q_dtype: torch.dtype, cache_dtype: torch.dtype, page: int, message: str
) -> None:
    cache = FakeKVCacheManager(1, 4, page, 2, 16, cache_dtype)
    md = build_metadata(cache, [(0, 5, 0)], [])
    q, k, v = qkv_rows([(0, 0, 5)], 2, 2, 16, seed=0, dtype=q_dtype)
    with pytest.raises(ValueError, match=message):
        FlashAttnAttention(2, 2, 16, 0).forward(q, k, v, md)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({}, "tokens_per_block to be a multiple of 256"),
        ({"tokens_per_block": 256, "kv_cache_dtype": "fp8"}, "no fp8 KV cache"),
        ({"tokens_per_block": 256, "device": "cpu"}, "fp16/bf16 models on CUDA"),
        ({"tokens_per_block": 256, "dtype": "float32"}, "fp16/bf16 models on CUDA"),
    ],
)
def test_llm_args_check_flash_attn_rules_up_front(tmp_path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlmArgs(model=str(tmp_path), attn_backend="flash_attn", **kwargs)


@pytest.mark.gpu
def test_gpu_real_flash_attn_matches_vanilla() -> None:
    """The same schedule through the real package (skipped where flash-attn does not import)."""
    pytest.importorskip("flash_attn")
    _schedule(_pair(4, 2, device="cuda"), atol=2e-2)
