"""BlockPool: KV block ids with reference counts and a cache of full blocks by content key.

Every block id in [0, num_blocks) is in exactly one of three states:
- owned: ref count >= 1, held by that many requests (a shared prefix block has several);
  it may carry a key (its content is final and findable) or not (still being written, or a
  duplicate of a block cached under the same key);
- evictable: ref count 0 but keyed; its KV is intact, so a later request with the same prefix
  can take it back (`acquire`). Kept in LRU order; allocation evicts from the old end;
- free: ref count 0, no key, contents meaningless.
`num_free_blocks` counts evictable blocks too: allocation can always reclaim them.
`check_invariants` verifies all of this (the tests run it after random operation sequences).

The pool knows nothing of requests or tokens; `KVCacheManager` keeps each request's block list
and decides when a block is full (`register`). Keys come from `block_hash.compute_block_keys`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .block_hash import BlockKey


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (the /metrics hit rate is hits / queries).

    queries: prompt tokens of requests looked up at admission; hits: of those, tokens whose
    KV came from the cache; evictions: cached blocks reclaimed by allocation.
    """

    queries: int = 0
    hits: int = 0
    evictions: int = 0

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        if not 0 <= hit_tokens <= query_tokens:
            raise ValueError(f"need 0 <= hits ({hit_tokens}) <= queries ({query_tokens})")
        self.queries += query_tokens
        self.hits += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Free list, ref counts, key -> block map and the LRU of evictable blocks.

    enable_reuse=False makes it a plain allocator: `register` keeps nothing, so released blocks
    go straight back to the free list and `find_cached_prefix` never hits.
    """

    def __init__(self, num_blocks: int, enable_reuse: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_reuse = enable_reuse
        self.stats = PrefixCacheStats()
        # Told each key whose block stops being cached (evicted or cleared): the recurrent
        # snapshots of hybrid models live only as long as their block (`state_snapshot_pool`).
        self.on_evict: Callable[[BlockKey], None] | None = None
        self.reset()

    def reset(self) -> None:
        """Every block free, the cache empty (the counters are kept: they are cumulative).
        `on_evict` hears of every cached key, as if each had been evicted."""
        if self.on_evict is not None:
            for key in list(getattr(self, "_block_of", ())):
                self.on_evict(key)
        # Popped from the end, so low ids go out first, as KVCacheManager did (stable layouts).
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._ref = [0] * self.num_blocks
        self._key_of: list[BlockKey | None] = [None] * self.num_blocks
        self._block_of: dict[BlockKey, int] = {}
        # Evictable blocks, least recently released first (insertion order of an OrderedDict).
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: plain free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Keyed blocks, owned or evictable."""
        return len(self._block_of)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds (what the KV usage gauge shows)."""
        return self.num_blocks - self.num_free_blocks

    def free_blocks_after_hit(self, hit_blocks: Iterable[int]) -> int:
        """`num_free_blocks` once `hit_blocks` are acquired: evictable hits stop being free.

        The admission check of a request with a prefix hit: its new blocks must fit in this,
        not in `num_free_blocks` (which still counts the hit blocks it is about to take).
        """
        return self.num_free_blocks - len({b for b in hit_blocks if b in self._evictable})

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_key(self, block_id: int) -> BlockKey | None:
        return self._key_of[block_id]

    def is_cached(self, key: BlockKey) -> bool:
        """Whether some block (owned or evictable) holds `key`."""
        return key in self._block_of

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` blocks owned once each, or None (allocating nothing) when too few.

        Never-cached free blocks go first; only then are evictable ones reclaimed, least
        recently used first, their keys dropped (their KV will be overwritten).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            return None
        out: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._drop_key(block)
                self.stats.evictions += 1
            self._ref[block] = 1
            out.append(block)
        return out

    def _drop_key(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            self._key_of[block] = None
            if self._block_of.get(key) == block:
                del self._block_of[key]
                if self.on_evict is not None:
                    self.on_evict(key)

    # ---- reuse -------------------------------------------------------------------------------
    def find_cached_prefix(
        self, block_keys: Sequence[BlockKey], max_blocks: int | None = None
    ) -> list[int]:
        """Blocks holding the longest run of leading keys that are all cached (no side effects).

        max_blocks: cap on the hit (`block_hash.max_reusable_blocks`: one prompt token must
        still run). Keys after the first miss are not looked at: a later block's KV depends on
        the missing one, so it could not be used even if present.
        """
        limit = len(block_keys) if max_blocks is None else max(0, min(max_blocks, len(block_keys)))
        out: list[int] = []
        if not self.enable_reuse:
            return out
        for key in block_keys[:limit]:
            block = self._block_of.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference to cached blocks (a prefix hit): evictable ones become owned again.

        Only keyed blocks may be acquired; new blocks come from `allocate`.
        """
        blocks = list(block_ids)
        for block in blocks:  # check all first: a bad id must not leave half the refs taken
            if self._key_of[block] is None:
                raise ValueError(f"block {block} is not cached; only cached blocks are acquired")
        for block in blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1

    def register(self, block_id: int, key: BlockKey) -> bool:
        """Make an owned, now-full block findable under `key`. Returns whether it was keyed.

        A key already cached under another block (two requests computed the same prefix in
        the same step) keeps the first block; this one stays unkeyed and is freed plainly on
        release. Registering a block under its own key again is a no-op.
        """
        if self._ref[block_id] < 1:
            raise ValueError(f"block {block_id} is not owned; register it before releasing it")
        current = self._key_of[block_id]
        if current is not None:
            if current != key:
                raise ValueError(f"block {block_id} is already cached under another key")
            return True
        if not self.enable_reuse or key in self._block_of:
            return False
        self._key_of[block_id] = key
        self._block_of[key] = block_id
        return True

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each of a request's blocks (in its order: first block first).

        They are released last block first, so the request's tail (the least shared part)
        reaches the LRU's old end before its head and is evicted first. A keyed block whose
        count reaches 0 becomes evictable at the recent end; an unkeyed one is free again.
        """
        for block in block_ids:  # check all first, as in `acquire`
            if self._ref[block] < 1:
                raise ValueError(f"block {block} is not owned; it cannot be released")
        counts: dict[int, int] = {}
        for block in block_ids:
            counts[block] = counts.get(block, 0) + 1
            if counts[block] > self._ref[block]:
                raise ValueError(f"block {block} released more often than it is owned")
        for block in reversed(block_ids):
            self._ref[block] -= 1
            if self._ref[block]:
                continue
            if self._key_of[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def clear_cache(self) -> int:
        """Forget every evictable block's key (they become plain free); owned keyed blocks stay
        findable. For a cache reset (new weights, tests). Returns how many were dropped."""
        dropped = len(self._evictable)
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._drop_key(block)
            self._free.append(block)
        return dropped

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is in exactly one state (module docstring)
        and the key maps agree with each other."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        evictable = set(self._evictable)
        for block in range(self.num_blocks):
            ref, key = self._ref[block], self._key_of[block]
            owned = ref > 0
            states = [owned, block in evictable, block in free]
            if sum(states) != 1:
                raise AssertionError(
                    f"block {block}: owned={owned} evictable={states[1]} free={states[2]}"
                )
            if ref < 0:
                raise AssertionError(f"block {block} has ref count {ref}")
            if block in evictable and key is None:
                raise AssertionError(f"evictable block {block} has no key")
            if block in free and key is not None:
                raise AssertionError(f"free block {block} still has a key")
            if key is not None and self._block_of.get(key) != block:
                raise AssertionError(f"block {block}'s key maps to {self._block_of.get(key)}")
        for key, block in self._block_of.items():
            if self._key_of[block] != key:
                raise AssertionError(f"key of block {block} disagrees with the key map")
        if len(free) + len(evictable) != self.num_free_blocks:
            raise AssertionError("num_free_blocks disagrees with the lists")
