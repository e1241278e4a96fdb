"""Per-request resources: seq slots (rows of per-slot device caches) and paged KV blocks."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch

from .block_hash import BlockKey
from .block_pool import BlockPool, PrefixCacheStats


class SeqSlotManager:
    """Hands out seq slots in [0, max_num_slots), always the lowest free one.

    Lowest-first keeps the live slots dense, so per-slot device caches (such as the mRoPE
    delta cache) touch a compact prefix.
    """

    def __init__(self, max_num_slots: int) -> None:
        if max_num_slots < 1:
            raise ValueError(f"max_num_slots must be >= 1, got {max_num_slots}")
        self.max_num_slots = max_num_slots
        self.reset()

    def reset(self) -> None:
        self._free: list[int] = list(range(self.max_num_slots))  # a heap (sorted is a valid heap)
        self._slots: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def get_slot(self, request_id: int) -> int | None:
        return self._slots.get(request_id)

    def acquire(self, request_id: int) -> int:
        """The request's slot, taking the lowest free one on first call."""
        slot = self._slots.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            raise RuntimeError(
                f"no free seq slot for request {request_id}: all {self.max_num_slots} are in use"
            )
        slot = heapq.heappop(self._free)
        self._slots[request_id] = slot
        return slot

    def release(self, request_id: int) -> None:
        """Return the request's slot. A request without a slot is ignored (cleanup paths)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            heapq.heappush(self._free, slot)


class KVCacheManager:
    """Paged KV cache: one tensor per attention layer plus host-side block bookkeeping.

    Each layer buffer is [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim] (index 0 = K,
    1 = V). A request owns a list of block ids sized for its claimed token count; token t of
    the request lives at slot `blocks[t // tokens_per_block] * tokens_per_block + t % tpb`.

    Block ids come from a `BlockPool`. With `enable_block_reuse` a request's full blocks are
    registered under their content keys once written (`register_blocks`), stay cached after
    `free` (evictable, reclaimed least recently used first when allocation needs them) and a
    later request with the same prefix starts from them (`add_cached_prefix`); a shared block
    is owned by every request that uses it. Without reuse the pool is a plain free list.
    NOTE: num_free_blocks (evictable cached blocks included) + blocks some request owns ==
    num_blocks at all times.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tokens_per_block: int,
        num_blocks: int,
        max_blocks_per_seq: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        enable_block_reuse: bool = False,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("tokens_per_block", tokens_per_block),
            ("num_blocks", num_blocks),
            ("max_blocks_per_seq", max_blocks_per_seq),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = max_blocks_per_seq
        self.dtype = dtype
        self.device = torch.device(device)
        self.enable_block_reuse = enable_block_reuse
        self.pool = BlockPool(num_blocks, enable_reuse=enable_block_reuse)
        shape = (num_blocks, 2, tokens_per_block, num_kv_heads, head_dim)
        # Zeros, not empty: a kernel that reads a padded position must not pick up NaN garbage.
        self._buffers = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.reset()

    def reset(self) -> None:
        """Forget every request and every cached block (buffers are kept, contents are stale)."""
        self.pool.reset()
        self._blocks: dict[int, list[int]] = {}
        # Leading blocks of each request already registered (or taken from the cache), so
        # registration never rescans a long request's blocks.
        self._num_registered: dict[int, int] = {}
        self._block_arrays: dict[int, np.ndarray] = {}
        self._num_tokens: dict[int, int] = {}

    # ---- sizes -------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_block(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tokens_per_block: int,
        dtype: torch.dtype,
    ) -> int:
        """Device bytes one block costs over all layers (K and V)."""
        elem = dtype.itemsize
        return num_layers * 2 * tokens_per_block * num_kv_heads * head_dim * elem

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.tokens_per_block

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now (cached blocks no request holds included)."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds."""
        return self.pool.num_used_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.pool.stats

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def get_buffers(self, layer_idx: int) -> torch.Tensor:
        """KV buffer of attention layer `layer_idx` (attention layers only are counted)."""
        return self._buffers[layer_idx]

    # ---- per-request blocks ------------------------------------------------------------------
    def has_request(self, request_id: int) -> bool:
        return request_id in self._blocks

    def get_num_tokens(self, request_id: int) -> int:
        """Tokens the request's blocks are sized for (0 for an unknown request)."""
        return self._num_tokens.get(request_id, 0)

    def get_block_ids(self, request_id: int) -> list[int]:
        return list(self._blocks.get(request_id, ()))

    def get_block_array(self, request_id: int) -> np.ndarray:
        """The request's block ids as a read-only int64 array, cached until its blocks change.

        The engine reads this every step for every request; rebuilding it each time costs more
        than the rest of the step preparation at high batch sizes.
        """
        arr = self._block_arrays.get(request_id)
        if arr is None:
            arr = np.asarray(self._blocks.get(request_id, ()), dtype=np.int64)
            arr.flags.writeable = False
            self._block_arrays[request_id] = arr
        return arr

    def _extra_blocks(self, request_id: int, total_tokens: int) -> int:
        have = len(self._blocks.get(request_id, ()))
        return max(0, self.blocks_for_tokens(total_tokens) - have)

    def can_fit(self, request_id: int, total_tokens: int) -> bool:
        """Whether the request could grow to `total_tokens` now (free blocks and per-seq cap)."""
        if self.blocks_for_tokens(total_tokens) > self.max_blocks_per_seq:
            return False
        return self._extra_blocks(request_id, total_tokens) <= self.pool.num_free_blocks

    def ensure_capacity(self, request_id: int, total_tokens: int) -> bool:
        """Grow the request's blocks to cover `total_tokens`; never shrinks.

        Returns False (allocating nothing) when the blocks are not available.
        Raises ValueError when `total_tokens` exceeds what one sequence may ever hold.
        """
        if total_tokens < 0:
            raise ValueError(f"total_tokens must be >= 0, got {total_tokens}")
        if self.blocks_for_tokens(total_tokens) > self.max_blocks_per_seq:
            raise ValueError(
                f"request {request_id} needs {total_tokens} tokens, more than "
                f"max_blocks_per_seq * tokens_per_block = {self.max_tokens_per_seq}"
            )
        extra = self._extra_blocks(request_id, total_tokens)
        new = self.pool.allocate(extra)
        if new is None:
            return False
        blocks = self._blocks.setdefault(request_id, [])
        blocks.extend(new)
        if extra:
            self._block_arrays.pop(request_id, None)
        self._num_tokens[request_id] = max(self._num_tokens.get(request_id, 0), total_tokens)
        return True

    def add_tokens(self, request_id: int, num_tokens: int) -> bool:
        """Claim `num_tokens` more tokens for the request (see `ensure_capacity`)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return self.ensure_capacity(request_id, self.get_num_tokens(request_id) + num_tokens)

    def free(self, request_id: int) -> None:
        """Drop the request's hold on its blocks: registered ones stay cached (evictable), the
        others are free again. An unknown request is ignored (cleanup paths)."""
        self._block_arrays.pop(request_id, None)
        blocks = self._blocks.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if blocks:
            # The pool releases the tail first, so the tail is evicted before the shared head.
            self.pool.release(blocks)

    # ---- prefix reuse ------------------------------------------------------------------------
    def find_cached_prefix(self, block_keys: Sequence[BlockKey], max_blocks: int) -> list[int]:
        """Cached blocks of the longest leading run of `block_keys` (no side effects)."""
        return self.pool.find_cached_prefix(block_keys, max_blocks)

    def free_blocks_after_hit(self, hit_blocks: Sequence[int]) -> int:
        """`num_free_blocks` once `hit_blocks` are taken (see `BlockPool`)."""
        return self.pool.free_blocks_after_hit(hit_blocks)

    def add_cached_prefix(self, request_id: int, hit_blocks: Sequence[int]) -> None:
        """Start a request that holds no blocks yet from cached blocks: they become its first
        blocks, their tokens already computed."""
        if self._blocks.get(request_id):
            raise ValueError(f"request {request_id} already holds blocks; a hit comes first")
        self.pool.acquire(hit_blocks)
        self._blocks[request_id] = list(hit_blocks)
        self._block_arrays.pop(request_id, None)
        self._num_tokens[request_id] = len(hit_blocks) * self.tokens_per_block
        self._num_registered[request_id] = len(hit_blocks)

    def num_registered_blocks(self, request_id: int) -> int:
        return self._num_registered.get(request_id, 0)

    def register_blocks(self, request_id: int, block_keys: Sequence[BlockKey]) -> None:
        """Make the request's leading blocks findable under `block_keys` (one key per full,
        written block, in order); blocks registered before are skipped."""
        blocks = self._blocks.get(request_id)
        if not blocks or not self.enable_block_reuse:
            return
        start = self._num_registered.get(request_id, 0)
        stop = min(len(block_keys), len(blocks))
        for i in range(start, stop):
            # False (another block holds this key): this one stays unkeyed; nothing to do.
            self.pool.register(blocks[i], block_keys[i])
        if stop > start:
            self._num_registered[request_id] = stop

    # ---- step tensors ------------------------------------------------------------------------
    def get_block_table(
        self,
        request_ids: Sequence[int],
        max_blocks: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Host int32 [len(request_ids), max_blocks] of block ids, padded with -1.

        With `out` (for example a pinned staging buffer of at least that shape) the table is
        written into its leading rows and columns and that view is returned.
        """
        max_blocks = self.max_blocks_per_seq if max_blocks is None else max_blocks
        table = np.full((len(request_ids), max_blocks), -1, dtype=np.int32)
        for row, rid in enumerate(request_ids):
            blocks = self._blocks.get(rid, ())
            if len(blocks) > max_blocks:
                raise ValueError(f"request {rid} has {len(blocks)} blocks, max_blocks={max_blocks}")
            table[row, : len(blocks)] = blocks
        result = torch.from_numpy(table)
        if out is None:
            return result
        view = out[: len(request_ids), :max_blocks]
        view.copy_(result)
        return view

    def _check_range(self, request_id: int, start: int, end: int) -> list[int]:
        blocks = self._blocks.get(request_id, [])
        if not 0 <= start <= end <= len(blocks) * self.tokens_per_block:
            raise ValueError(
                f"token range [{start}, {end}) of request {request_id} is outside its "
                f"{len(blocks)} block(s) of {self.tokens_per_block} tokens"
            )
        return blocks

    def slot_mapping_for(self, request_id: int, start: int, end: int) -> list[int]:
        """Cache slot of each token position in [start, end) of the request."""
        blocks = self._check_range(request_id, start, end)
        tpb = self.tokens_per_block
        return [blocks[p // tpb] * tpb + p % tpb for p in range(start, end)]

    def build_slot_mapping(
        self,
        request_ids: Sequence[int],
        starts: Sequence[int],
        ends: Sequence[int],
    ) -> torch.Tensor:
        """Host int64 slot mapping of the packed ranges [starts[i], ends[i]) of each request."""
        if not len(request_ids) == len(starts) == len(ends):
            raise ValueError("request_ids, starts and ends must have the same length")
        tpb = self.tokens_per_block
        parts: list[np.ndarray] = []
        for rid, start, end in zip(request_ids, starts, ends, strict=True):
            blocks = self._check_range(rid, start, end)
            if end - start == 1:  # decode: skip numpy overhead for the common single token
                parts.append(np.array([blocks[start // tpb] * tpb + start % tpb], dtype=np.int64))
                continue
            pos = np.arange(start, end, dtype=np.int64)
            parts.append(np.asarray(blocks, dtype=np.int64)[pos // tpb] * tpb + pos % tpb)
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        return torch.from_numpy(np.concatenate(parts))
