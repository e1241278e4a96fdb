"""Triton attention backend against the vanilla reference: prefill, chunked prefill over a
cached prefix, split-K decode, mixed batches, GQA, padded graph rows and the KV store.

On CPU the kernels run under TRITON_INTERPRET=1 at tiny sizes (fp32); GPU-marked tests repeat
the checks at larger sizes in bf16 and capture/replay the decode path in a CUDA graph.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from paged_kv_helpers import FakeKVCacheManager, build_metadata  # noqa: E402

from tensorrt_llm._torch.attention_backend import (  # noqa: E402
    VanillaAttention,
    get_attention_backend,
)
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton import TritonAttention  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton_kernels import store_kv  # noqa: E402

HEAD_DIM, TPB = 16, 4


def _numpy_scalar_index_shim() -> None:
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a loop bound
    with `int(array)`, which numpy >= 2.4 rejects. Index through `reshape(-1)[0]` instead.
    Test-harness only: compiled kernels never go through the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_shim", False):
        return

    def patched(tensor, scope) -> None:  # noqa: ANN001
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        )

    patched._scalar_index_shim = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


_numpy_scalar_index_shim()


def _qkv(rows, heads, kv_heads, head_dim, seed, dtype=torch.float32, device="cpu"):
    """Deterministic per-request q/k/v: `rows` is [(rid, first_pos, n)], each token's values
    depend only on (rid, position), so any chunking of a request sees the same sequence."""
    parts = []
    for rid, first, n in rows:
        gen = torch.Generator().manual_seed(seed * 1000 + rid)
        full = torch.randn(first + n, (heads + 2 * kv_heads) * head_dim, generator=gen)
        parts.append(full[first : first + n])
    qkv = torch.cat(parts).to(device=device, dtype=dtype)
    return qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)


def _rows(context, generation):
    return [(r, c, n) for r, n, c in context] + [(r, c, 1) for r, c in generation]


class _Pair:
    """A vanilla and a triton backend, each with its own cache built from one seed, so the
    two caches hold identical block layouts and identical contents step after step."""

    def __init__(self, heads, kv_heads, head_dim=HEAD_DIM, blocks=40, tpb=TPB, splits=None,
                 dtype=torch.float32, device="cpu"):
        self.shape = (heads, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.ref_cache = FakeKVCacheManager(1, blocks, tpb, kv_heads, head_dim, dtype, device)
        self.tri_cache = FakeKVCacheManager(1, blocks, tpb, kv_heads, head_dim, dtype, device)
        self.ref = VanillaAttention(heads, kv_heads, head_dim, 0)
        self.tri = TritonAttention(heads, kv_heads, head_dim, 0, num_kv_splits=splits)

    def step(self, context, generation, seed=0, pad_to=None, atol=1e-4):
        md_ref = build_metadata(self.ref_cache, context, generation, pad_to, self.device)
        md_tri = build_metadata(self.tri_cache, context, generation, pad_to, self.device)
        q, k, v = _qkv(_rows(context, generation), *self.shape, seed, self.dtype, self.device)
        if pad_to is not None:
            extra = pad_to - q.shape[0]
            q, k, v = (torch.cat([t, torch.full_like(t[:1], 7.0).expand(extra, -1)])
                       for t in (q, k, v))
        expected = self.ref.forward(q, k, v, md_ref)
        got = self.tri.forward(q, k, v, md_tri)
        assert got.shape == q.shape
        n = md_tri.num_tokens
        torch.testing.assert_close(got[:n].float(), expected[:n].float(), atol=atol, rtol=atol)
        return got, md_tri


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_prefill_then_chunked_prefill_and_decode(heads: int, kv_heads: int) -> None:
    pair = _Pair(heads, kv_heads, splits=3)
    pair.step([(0, 21, 0), (1, 7, 0), (2, 10, 0)], [])  # pure prefill, several tiles
    pair.step([(2, 18, 10)], [(0, 21), (1, 7)])  # chunk over a cached prefix + decodes
    pair.step([], [(0, 22), (1, 8), (2, 28)])  # pure decode, split-K


def test_pure_decode_split_counts_and_ragged_lengths() -> None:
    lengths = [1, 5, 13, 34]  # prompt lengths: not multiples of the split or block sizes
    for splits in (1, 2, 5):
        pair = _Pair(2, 1, splits=splits)
        pair.step([(r, n, 0) for r, n in enumerate(lengths)], [])
        for i in range(2):
            pair.step([], [(r, n + i) for r, n in enumerate(lengths)])


def test_heuristic_splits_and_mixed_batch_with_padding() -> None:
    pair = _Pair(4, 1)  # GQA group of 4, heuristic split count
    pair.step([(0, 9, 0), (1, 3, 0)], [])
    got, md = pair.step([(2, 6, 0)], [(0, 9), (1, 3)], pad_to=12)
    assert torch.equal(got[md.num_tokens :], torch.zeros_like(got[md.num_tokens :]))


def test_padded_decode_rows_do_not_crash_or_store() -> None:
    """Graph-bucket padding: extra generation rows with slot -1, seq_len 1, num_cached 0 and
    a block table row pointing at block 0."""
    heads, kv_heads = 2, 2
    pair = _Pair(heads, kv_heads, splits=2)
    pair.step([(0, 11, 0)], [])
    md = build_metadata(pair.tri_cache, [], [(0, 11)])
    pad = 3
    md = _pad_generation_rows(md, pad)
    before = pair.tri_cache.get_buffers(0).clone()
    q, k, v = _qkv([(0, 11, 1)], heads, kv_heads, HEAD_DIM, seed=0)
    q, k, v = (torch.cat([t, torch.randn(pad, t.shape[1])]) for t in (q, k, v))
    out = pair.tri.forward(q, k, v, md)
    ref_md = build_metadata(pair.ref_cache, [], [(0, 11)])
    expected = pair.ref.forward(q[:1], k[:1], v[:1], ref_md)
    torch.testing.assert_close(out[:1], expected, atol=1e-4, rtol=1e-4)
    # The padded rows' output is ignored (here it is NaN: block 0 slot 0 of the fake cache
    # was never written); they only must not crash nor store.
    assert out.shape == q.shape
    changed = (pair.tri_cache.get_buffers(0) != before) & ~torch.isnan(before)
    changed |= torch.isnan(before) & ~torch.isnan(pair.tri_cache.get_buffers(0))
    assert int(changed.any(dim=(-1, -2)).sum()) == 2  # one K and one V slot: the real token


def _pad_generation_rows(md: AttentionMetadata, pad: int) -> AttentionMetadata:
    def cat(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((pad, *t.shape[1:]), value, dtype=t.dtype)])

    tables = cat(md.block_tables, -1)
    tables[-pad:, 0] = 0
    seq_lens = cat(md.seq_lens, 1)
    cached = cat(md.num_cached_tokens, 0)
    cu = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    return AttentionMetadata(
        num_contexts=0, num_generations=md.num_generations + pad, num_ctx_tokens=0,
        num_tokens=md.num_tokens, seq_lens_cpu=seq_lens, num_cached_tokens_cpu=cached,
        seq_lens=seq_lens, num_cached_tokens=cached, cu_seqlens_q=cu, block_tables=tables,
        slot_mapping=cat(md.slot_mapping, -1), seq_slots=cat(md.seq_slots, 0),
        seq_slots_cpu=cat(md.seq_slots_cpu, 0), kv_cache_manager=md.kv_cache_manager,
        tokens_per_block=md.tokens_per_block,
    )


def test_store_kv_skips_minus_one_and_converts_dtype() -> None:
    cache = torch.full((3, 2, TPB, 2, HEAD_DIM), float("nan"), dtype=torch.float64)
    k = torch.randn(5, 2, HEAD_DIM)
    v = torch.randn(5, 2, HEAD_DIM)
    slots = torch.tensor([5, -1, 0, 11, -1], dtype=torch.int64)
    store_kv(cache, k, v, slots)
    for row, slot in ((0, 5), (2, 0), (3, 11)):
        block, off = divmod(slot, TPB)
        torch.testing.assert_close(cache[block, 0, off], k[row].double())
        torch.testing.assert_close(cache[block, 1, off], v[row].double())
    assert int((~torch.isnan(cache[..., 0, 0])).sum()) == 6  # 3 tokens x (K, V)
    with pytest.raises(ValueError, match="slot_mapping has 2 rows"):
        store_kv(cache, k, v, slots[:2])


def test_no_cache_prefill_registry_and_bad_input() -> None:
    heads, kv_heads = 2, 1
    q, k, v = _qkv([(0, 0, 9)], heads, kv_heads, HEAD_DIM, seed=1)
    md = build_metadata(None, [(0, 9, 0)], [])
    tri = get_attention_backend("triton")(heads, kv_heads, HEAD_DIM, 0, HEAD_DIM**-0.5)
    assert isinstance(tri, TritonAttention)
    ref = VanillaAttention(heads, kv_heads, HEAD_DIM, 0)
    torch.testing.assert_close(tri.forward(q, k, v, md), ref.forward(q, k, v, md))
    with pytest.raises(ValueError, match="not divisible"):
        TritonAttention(4, 3, HEAD_DIM, 0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        TritonAttention(2, 1, HEAD_DIM, 0, num_kv_splits=0)
    wrong = build_metadata(FakeKVCacheManager(1, 8, TPB, 2, HEAD_DIM), [(0, 9, 0)], [])
    with pytest.raises(ValueError, match="does not hold"):
        tri.forward(q, k, v, wrong)
    with pytest.raises(ValueError, match="widths"):
        tri.forward(q, k[:, :8], v, wrong)
    md = build_metadata(FakeKVCacheManager(1, 8, TPB, kv_heads, HEAD_DIM), [(0, 9, 0)], [])
    with pytest.raises(ValueError, match="the step needs 9"):
        tri.forward(q[:5], k[:5], v[:5], md)
