"""VisionEmbeddingCache: byte bound, LRU order, deepstack entries, views copied."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.models.vision_embedding_cache import VisionEmbeddingCache

HIDDEN = 8
ROW = HIDDEN * 4  # bytes of one float32 row


def _emb(rows: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((rows, HIDDEN), fill)


def test_get_put_and_counters() -> None:
    cache = VisionEmbeddingCache(capacity_bytes=10 * ROW)
    assert cache.get(b"a") is None and cache.misses == 1
    assert cache.put(b"a", _emb(4, 1.0))
    entry = cache.get(b"a")
    assert entry is not None and torch.equal(entry.embeddings, _emb(4, 1.0))
    assert entry.deepstack == () and cache.hits == 1
    assert cache.nbytes == 4 * ROW and len(cache) == 1 and b"a" in cache


def test_byte_bound_evicts_least_recently_used() -> None:
    cache = VisionEmbeddingCache(capacity_bytes=10 * ROW)
    for key in (b"a", b"b", b"c"):
        assert cache.put(key, _emb(3))
    assert cache.nbytes == 9 * ROW
    assert cache.get(b"a") is not None  # a is now the most recent; b the oldest
    assert cache.put(b"d", _emb(3))
    assert b"b" not in cache and all(k in cache for k in (b"a", b"c", b"d"))
    assert cache.evictions == 1 and cache.nbytes == 9 * ROW
    assert cache.put(b"e", _emb(7))  # needs two more evictions: c, then a
    assert b"c" not in cache and b"a" not in cache and b"d" in cache
    assert cache.nbytes == 10 * ROW <= cache.capacity_bytes


def test_entry_larger_than_capacity_is_not_stored_and_evicts_nothing() -> None:
    cache = VisionEmbeddingCache(capacity_bytes=4 * ROW)
    assert cache.put(b"a", _emb(2))
    assert not cache.put(b"big", _emb(5))
    assert b"a" in cache and b"big" not in cache and cache.evictions == 0
    assert not VisionEmbeddingCache(0).put(b"x", _emb(1))


def test_replacing_a_key_keeps_the_count_right() -> None:
    cache = VisionEmbeddingCache(capacity_bytes=10 * ROW)
    cache.put(b"a", _emb(4))
    cache.put(b"a", _emb(2, 5.0))
    assert cache.nbytes == 2 * ROW and len(cache) == 1
    assert cache.pop(b"a") is not None and cache.nbytes == 0
    assert cache.pop(b"a") is None
    cache.put(b"b", _emb(1))
    cache.clear()
    assert cache.nbytes == 0 and len(cache) == 0


def test_deepstack_levels_count_in_the_bound() -> None:
    cache = VisionEmbeddingCache(capacity_bytes=9 * ROW)
    levels = [_emb(3, float(i)) for i in range(2)]
    assert cache.put(b"q3", _emb(3), levels)  # 3 rows main + 2 x 3 rows deepstack
    entry = cache.get(b"q3")
    assert entry is not None and entry.nbytes == 9 * ROW and len(entry.deepstack) == 2
    assert torch.equal(entry.deepstack[1], _emb(3, 1.0))
    assert not cache.put(b"more", _emb(1), [_emb(1)] * 9)
    with pytest.raises(ValueError, match="rows"):
        cache.put(b"bad", _emb(3), [_emb(2)])


def test_views_of_a_packed_output_are_copied() -> None:
    """The tower's packed output split per item: storing the view would keep all of it."""
    packed = torch.randn(100, HIDDEN)
    first, _ = packed.split([10, 90])
    cache = VisionEmbeddingCache(capacity_bytes=100 * ROW)
    cache.put(b"a", first)
    entry = cache.get(b"a")
    assert entry is not None and torch.equal(entry.embeddings, first)
    assert entry.embeddings.untyped_storage().nbytes() == 10 * ROW
    # A tensor that owns its storage is kept as is (no copy).
    whole = torch.randn(4, HIDDEN)
    cache.put(b"b", whole)
    got = cache.get(b"b")
    assert got is not None and got.embeddings.data_ptr() == whole.data_ptr()
