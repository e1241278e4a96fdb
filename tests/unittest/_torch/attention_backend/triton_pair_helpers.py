"""A vanilla and a fast attention backend side by side on identical paged caches, for the
Triton attention tests (`test_triton_attention*.py`) and the flash_attn backend's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from paged_kv_helpers import FakeKVCacheManager, build_metadata  # noqa: E402

from tensorrt_llm._torch.attention_backend import VanillaAttention  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton import TritonAttention  # noqa: E402

HEAD_DIM, TPB = 16, 4


def qkv_rows(rows, heads, kv_heads, head_dim, seed, dtype=torch.float32, device="cpu"):
    """Deterministic per-request q/k/v: `rows` is [(rid, first_pos, n)], each token's values
    depend only on (rid, position), so any chunking of a request sees the same sequence."""
    parts = []
    for rid, first, n in rows:
        gen = torch.Generator().manual_seed(seed * 1000 + rid)
        full = torch.randn(first + n, (heads + 2 * kv_heads) * head_dim, generator=gen)
        parts.append(full[first : first + n])
    qkv = torch.cat(parts).to(device=device, dtype=dtype)
    return qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)


def step_rows(context, generation):
    return [(r, c, n) for r, n, c in context] + [(r, c, 1) for r, c in generation]


class Pair:
    """A vanilla and a fast backend (Triton unless `fast(heads, kv_heads, head_dim, layer)` is
    given), each with its own cache built from one seed, so the two caches hold identical block
    layouts and identical contents step after step."""

    def __init__(
        self,
        heads,
        kv_heads,
        head_dim=HEAD_DIM,
        blocks=40,
        tpb=TPB,
        splits=None,
        dtype=torch.float32,
        device="cpu",
        cache_dtype=None,
        fast=None,
    ):
        self.shape = (heads, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        cache_dtype = cache_dtype or dtype
        self.ref_cache = FakeKVCacheManager(1, blocks, tpb, kv_heads, head_dim, cache_dtype, device)
        self.tri_cache = FakeKVCacheManager(1, blocks, tpb, kv_heads, head_dim, cache_dtype, device)
        self.ref = VanillaAttention(heads, kv_heads, head_dim, 0)
        if fast is None:
            self.tri = TritonAttention(heads, kv_heads, head_dim, 0, num_kv_splits=splits)
        else:
            self.tri = fast(heads, kv_heads, head_dim, 0)

    def step(self, context, generation, seed=0, pad_to=None, atol=1e-4, kv_round=None):
        md_ref = build_metadata(self.ref_cache, context, generation, pad_to, self.device)
        md_tri = build_metadata(self.tri_cache, context, generation, pad_to, self.device)
        q, k, v = qkv_rows(
            step_rows(context, generation), *self.shape, seed, self.dtype, self.device
        )
        if kv_round is not None:
            k, v = kv_round(k), kv_round(v)
        if pad_to is not None:
            extra = pad_to - q.shape[0]
            q, k, v = (
                torch.cat([t, torch.full_like(t[:1], 7.0).expand(extra, -1)]) for t in (q, k, v)
            )
        expected = self.ref.forward(q, k, v, md_ref)
        got = self.tri.forward(q, k, v, md_tri)
        assert got.shape == q.shape
        n = md_tri.num_tokens
        torch.testing.assert_close(got[:n].float(), expected[:n].float(), atol=atol, rtol=atol)
        return got, md_tri
