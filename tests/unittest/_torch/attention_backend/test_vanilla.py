"""Vanilla paged attention against dense causal SDPA: mixed context + generation batches,
chunked prefill over a cached prefix, padding rows, the no-cache path and bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from paged_kv_helpers import FakeKVCacheManager, build_metadata  # noqa: E402

from tensorrt_llm._torch.attention_backend import (  # noqa: E402
    VanillaAttention,
    get_attention_backend,
)

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full-sequence causal attention, `[L, heads*D]` in and out (reference)."""
    length = q.shape[0]
    qh = q.view(length, HEADS, HEAD_DIM).transpose(0, 1)
    kh = k.view(length, KV_HEADS, HEAD_DIM).repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    vh = v.view(length, KV_HEADS, HEAD_DIM).repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return out.transpose(0, 1).reshape(length, -1)


def _sequence(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(length, HEADS * HEAD_DIM, generator=gen),
        torch.randn(length, KV_HEADS * HEAD_DIM, generator=gen),
        torch.randn(length, KV_HEADS * HEAD_DIM, generator=gen),
    )


def _run_step(attn, manager, seqs, context, generation, pad_to=None, device="cpu"):
    md = build_metadata(manager, context, generation, pad_to=pad_to, device=device)
    rows = [(r, c, n) for r, n, c in context] + [(r, c, 1) for r, c in generation]
    q, k, v = (torch.cat([seqs[r][i][c : c + n] for r, c, n in rows]) for i in range(3))
    if pad_to is not None:
        extra = pad_to - q.shape[0]
        q, k, v = (torch.cat([t, torch.full((extra, t.shape[1]), 7.0)]) for t in (q, k, v))
    return attn.forward(q.to(device), k.to(device), v.to(device), md).cpu(), rows


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_chunked_prefill_then_mixed_batches_match_dense(device: str) -> None:
    lengths = [9, 6, 13]
    seqs = [_sequence(n, seed=i) for i, n in enumerate(lengths)]
    dense = [_dense(*s) for s in seqs]
    manager = FakeKVCacheManager(2, 24, 4, KV_HEADS, HEAD_DIM, device=device)
    attn = VanillaAttention(HEADS, KV_HEADS, HEAD_DIM, layer_idx=1)
    steps = [
        ([(0, 5, 0), (1, 4, 0), (2, 3, 0)], []),  # three context chunks
        ([(2, 6, 3)], [(0, 5), (1, 4)]),  # a chunk over a cached prefix + two decodes
        ([(2, 4, 9), (0, 2, 6)], [(1, 5)]),  # two cached-prefix chunks + a decode
        ([], [(0, 8), (2, 13 - 1)]),  # pure generation
    ]
    for context, generation in steps:
        out, rows = _run_step(attn, manager, seqs, context, generation, device=device)
        expected = torch.cat([dense[r][c : c + n] for r, c, n in rows])
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.isnan(manager.get_buffers(0)).all(), "layer 0 must stay untouched"


def test_padding_rows_are_zero_and_not_stored() -> None:
    seqs = [_sequence(5, seed=3)]
    manager = FakeKVCacheManager(1, 8, 4, KV_HEADS, HEAD_DIM)
    attn = VanillaAttention(HEADS, KV_HEADS, HEAD_DIM, layer_idx=0)
    out, _ = _run_step(attn, manager, seqs, [(0, 5, 0)], [], pad_to=8)
    torch.testing.assert_close(out[:5], _dense(*seqs[0]))
    assert torch.equal(out[5:], torch.zeros(3, HEADS * HEAD_DIM))
    # exactly the 5 real tokens were stored (K and V), the padded slot -1 rows were skipped
    stored = ~torch.isnan(manager.get_buffers(0)[..., 0, 0])  # [blocks, 2, tokens_per_block]
    assert stored.sum(dim=(0, 2)).tolist() == [5, 5]


def test_no_cache_prefill_matches_dense() -> None:
    seqs = [_sequence(7, seed=4), _sequence(3, seed=5)]
    attn = VanillaAttention(HEADS, KV_HEADS, HEAD_DIM, layer_idx=0)
    out, _ = _run_step(attn, None, seqs, [(0, 7, 0), (1, 3, 0)], [])
    torch.testing.assert_close(out, torch.cat([_dense(*s) for s in seqs]), atol=1e-5, rtol=1e-5)


def test_bad_input_raises() -> None:
    attn = VanillaAttention(HEADS, KV_HEADS, HEAD_DIM, layer_idx=0)
    seqs = [_sequence(6, seed=6)]
    with pytest.raises(ValueError, match="no kv_cache_manager"):
        _run_step(attn, None, seqs, [(0, 3, 3)], [])
    with pytest.raises(ValueError, match="not divisible"):
        VanillaAttention(4, 3, 8, 0)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope")
    assert get_attention_backend("vanilla") is VanillaAttention
