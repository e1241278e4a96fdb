"""BlockPool: allocation order, prefix hits, shared ref counts, LRU eviction, invariants."""

from __future__ import annotations

import random

import pytest

from tensorrt_llm._torch.pyexecutor.block_hash import compute_block_keys, max_reusable_blocks
from tensorrt_llm._torch.pyexecutor.block_pool import BlockPool, PrefixCacheStats

TPB = 4


def _keys(n: int, salt: str = "") -> list[bytes]:
    """n chained keys of a distinct token sequence per salt."""
    return compute_block_keys(list(range(n * TPB)), TPB, cache_salt=salt or None)


def _fill(pool: BlockPool, keys: list[bytes]) -> list[int]:
    """A request that computed `keys`' blocks: allocate, register each, return its blocks."""
    blocks = pool.allocate(len(keys))
    assert blocks is not None
    for block, key in zip(blocks, keys, strict=True):
        assert pool.register(block, key)
    return blocks


def test_allocate_low_ids_first_and_all_or_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) is None and pool.num_free_blocks == 2  # nothing taken
    assert pool.allocate(0) == []
    pool.release([0, 1])
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_hit_after_release_and_cap() -> None:
    pool = BlockPool(8)
    keys = _keys(3)
    blocks = _fill(pool, keys)
    pool.release(blocks)
    assert pool.num_evictable_blocks == 3 and pool.num_free_blocks == 8
    assert pool.find_cached_prefix(keys) == blocks
    # A 12-token prompt may reuse only 2 blocks: its last token must still run.
    assert pool.find_cached_prefix(keys, max_reusable_blocks(12, TPB)) == blocks[:2]
    assert pool.find_cached_prefix(keys, 0) == [] and pool.find_cached_prefix(keys, -1) == []
    # The longest run of leading hits: a miss in the middle ends it.
    other = _keys(3, "x")
    assert pool.find_cached_prefix([keys[0], other[1], keys[2]]) == blocks[:1]
    assert pool.find_cached_prefix(other) == []
    pool.check_invariants()


def test_free_blocks_after_hit_excludes_evictable_hits() -> None:
    pool = BlockPool(5)
    keys = _keys(3)
    blocks = _fill(pool, keys)
    pool.release(blocks[1:])  # blocks[0] still owned, blocks[1:] evictable
    hit = pool.find_cached_prefix(keys)
    assert pool.num_free_blocks == 4 and pool.free_blocks_after_hit(hit) == 2
    pool.acquire(hit)
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_two_requests_share_a_prefix() -> None:
    pool = BlockPool(8)
    keys = _keys(3)
    a_blocks = _fill(pool, keys)  # request A computed 3 blocks
    # Request B hits A's first two blocks while A still runs, then allocates its own third.
    hit = pool.find_cached_prefix(keys[:2])
    pool.acquire(hit)
    b_tail = pool.allocate(1)
    assert b_tail is not None
    assert [pool.ref_count(b) for b in a_blocks] == [2, 2, 1]
    pool.release(a_blocks)  # A finishes
    assert [pool.ref_count(b) for b in a_blocks] == [1, 1, 0]
    assert pool.is_evictable(a_blocks[2]) and not pool.is_evictable(a_blocks[0])
    pool.check_invariants()
    pool.release(hit + b_tail)  # B finishes; its unkeyed tail goes back to the free list
    assert all(pool.ref_count(b) == 0 for b in a_blocks + b_tail)
    assert pool.num_evictable_blocks == 3 and pool.block_key(b_tail[0]) is None
    pool.check_invariants()


def test_duplicate_register_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    key = _keys(1)[0]
    a, b = pool.allocate(1), pool.allocate(1)
    assert a is not None and b is not None
    assert pool.register(a[0], key)
    assert pool.register(a[0], key)  # again: a no-op
    assert not pool.register(b[0], key)  # same content computed twice in one step
    assert pool.find_cached_prefix([key]) == a
    pool.release(b)
    assert pool.num_evictable_blocks == 0  # the duplicate was freed plainly
    with pytest.raises(ValueError, match="another key"):
        pool.register(a[0], _keys(1, "z")[0])
    pool.release(a)
    with pytest.raises(ValueError, match="not owned"):
        pool.register(a[0], key)
    pool.check_invariants()


def test_lru_evicts_least_recent_and_tail_first() -> None:
    pool = BlockPool(6)
    old = _fill(pool, _keys(3, "old"))
    new = _fill(pool, _keys(3, "new"))
    pool.release(old)
    pool.release(new)
    # No plain free block left: allocation reclaims cached ones, oldest release first and,
    # within a request, its last block first.
    assert pool.allocate(2) == [old[2], old[1]]
    assert pool.stats.evictions == 2
    assert pool.find_cached_prefix(_keys(3, "old")) == [old[0]]
    # A hit refreshes recency: `old[0]` re-acquired and released goes to the recent end.
    pool.acquire([old[0]])
    pool.release([old[0]])
    assert pool.allocate(3) == [new[2], new[1], new[0]]
    assert pool.find_cached_prefix(_keys(3, "new")) == []
    pool.check_invariants()


def test_allocation_prefers_plain_free_blocks_then_evicts_under_pressure() -> None:
    pool = BlockPool(6)
    cached = _fill(pool, _keys(4))
    pool.release(cached)
    assert pool.num_free_blocks == 6 and pool.num_evictable_blocks == 4
    first = pool.allocate(2)  # the two never-cached blocks
    assert first == [4, 5] and pool.num_evictable_blocks == 4
    second = pool.allocate(3)  # pressure: three cached blocks go, tail first
    assert second == [cached[3], cached[2], cached[1]]
    assert pool.num_cached_blocks == 1
    assert pool.find_cached_prefix(_keys(4)) == [cached[0]]
    assert pool.allocate(2) is None  # one reclaimable block left
    pool.check_invariants()


def test_acquire_and_release_errors_leave_state_unchanged() -> None:
    pool = BlockPool(4)
    blocks = _fill(pool, _keys(2))
    plain = pool.allocate(1)
    assert plain is not None
    with pytest.raises(ValueError, match="not cached"):
        pool.acquire([blocks[0], plain[0]])
    assert pool.ref_count(blocks[0]) == 1
    with pytest.raises(ValueError, match="released more often"):
        pool.release([blocks[0], blocks[0]])
    assert pool.ref_count(blocks[0]) == 1
    pool.release(blocks + plain)
    with pytest.raises(ValueError, match="not owned"):
        pool.release(blocks)
    pool.check_invariants()


def test_reuse_disabled_is_a_plain_allocator() -> None:
    pool = BlockPool(4, enable_reuse=False)
    keys = _keys(2)
    blocks = pool.allocate(2)
    assert blocks is not None
    assert not pool.register(blocks[0], keys[0])
    pool.release(blocks)
    assert pool.num_evictable_blocks == 0 and pool.find_cached_prefix(keys) == []
    pool.check_invariants()


def test_clear_cache_frees_evictable_keeps_owned() -> None:
    pool = BlockPool(6)
    gone = _fill(pool, _keys(2, "a"))
    kept = _fill(pool, _keys(2, "b"))
    pool.release(gone)
    assert pool.clear_cache() == 2
    assert pool.find_cached_prefix(_keys(2, "a")) == []
    assert pool.find_cached_prefix(_keys(2, "b")) == kept
    pool.check_invariants()


def test_stats_record_and_hit_rate() -> None:
    stats = PrefixCacheStats()
    assert stats.hit_rate == 0.0
    stats.record(100, 64)
    stats.record(28, 0)
    assert (stats.queries, stats.hits) == (128, 64) and stats.hit_rate == 0.5
    with pytest.raises(ValueError):
        stats.record(4, 8)


def test_check_invariants_catches_corruption() -> None:
    """The checker must be able to fail (else the random test below proves nothing)."""
    pool = BlockPool(4)
    blocks = _fill(pool, _keys(1))
    pool.release(blocks)
    pool._free.append(blocks[0])  # evictable and free at once
    with pytest.raises(AssertionError, match="evictable"):
        pool.check_invariants()
    pool = BlockPool(4)
    pool._ref[3] = 1  # owned but still on the free list
    with pytest.raises(AssertionError, match="owned"):
        pool.check_invariants()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants(seed: int) -> None:
    """A few thousand admissions (with prefix hits), growths, registrations and releases over
    a small pool of shared prefixes; the invariants hold after every operation."""
    rng = random.Random(seed)
    pool = BlockPool(24)
    prefixes = [_keys(6, f"p{i}") for i in range(5)]
    live: dict[int, tuple[list[bytes], list[int]]] = {}  # request -> (its keys, its blocks)
    next_id = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:  # admit: hit a cached prefix, allocate the rest
            keys = prefixes[rng.randrange(len(prefixes))][: rng.randint(1, 6)]
            hit = pool.find_cached_prefix(keys, rng.randint(0, len(keys)))
            extra = len(keys) - len(hit)
            if extra > pool.free_blocks_after_hit(hit):
                continue  # not enough room once the hit blocks are taken back
            pool.acquire(hit)
            new = pool.allocate(extra)
            assert new is not None
            live[next_id] = (keys, hit + new)
            next_id += 1
            pool.stats.record(len(keys) * TPB, len(hit) * TPB)
        elif op < 0.6 and live:  # a step filled blocks: register them
            rid = rng.choice(list(live))
            keys, blocks = live[rid]
            # Blocks grown by generation (past the keys) stay unkeyed.
            for key, block in zip(keys, blocks[: len(keys)], strict=True):
                pool.register(block, key)
        elif op < 0.7 and live:  # generation grew the request by an unkeyed block
            rid = rng.choice(list(live))
            more = pool.allocate(1)
            if more is not None:
                live[rid][1].extend(more)
        elif live:  # finish or preempt
            rid = rng.choice(list(live))
            pool.release(live.pop(rid)[1])
        pool.check_invariants()
        owned = sum(pool.ref_count(b) > 0 for b in range(pool.num_blocks))
        assert owned + pool.num_free_blocks == pool.num_blocks
        refs = sum(pool.ref_count(b) for b in range(pool.num_blocks))
        assert refs == sum(len(blocks) for _, blocks in live.values())
    assert pool.stats.hits > 0 and pool.stats.evictions > 0
    for _, blocks in live.values():
        pool.release(blocks)
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()
