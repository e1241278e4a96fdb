"""VisionEmbeddingCache: vision-tower outputs by media content hash, bounded in bytes (LRU).

What the model needs of one item after the tower: its merged embeddings `[n_tokens, hidden]`
and, for Qwen3-VL (`has_deepstack`), one `[n_tokens, hidden]` tensor per deepstack level
(`VisionTowerOutput`). Both are stored, on the device they were computed on, so a repeated
image (or a request whose prefix hit ends inside an image) skips the tower.

It lives with the models (not pyexecutor) because `QwenVLModelBase._encode_step_media` is its
user and models must not import the executor; the executor creates it and hands it over.

NOTE: the tower packs every item of a step into one output and the model splits it; a split is
a view that keeps the whole packed tensor alive. `put` copies such views, so the byte count is
what the cache really holds.

NOTE (tensor parallelism): the tower is data-parallel, so every rank must skip the same cached
items. Each rank holds its own cache of rank 0's capacity, built at the same step
(`tp_worker.py`), and the only gets / puts are the model's encode step, run on every rank with
the same params, hashes and (all-gathered) entry sizes: hits, misses and evictions are the same
everywhere. Nothing may touch one rank's cache alone; `vision_data_parallel.check_same_items`
fails every rank at once if their planned items ever differ.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is the whole of its storage, else a compact copy."""
    own_bytes = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == own_bytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class VisionEmbeddingEntry:
    """One item's tower outputs: main embeddings and the deepstack levels (empty if none)."""

    embeddings: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeddings, *self.deepstack))


class VisionEmbeddingCache:
    """LRU map content hash -> `VisionEmbeddingEntry`, never above `capacity_bytes` in total.

    capacity_bytes must come out of the memory the KV cache is sized from (the executor
    creates the cache before KV sizing), or its growth could run the device out of memory.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, VisionEmbeddingEntry] = OrderedDict()
        self._nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        """Bytes the stored tensors take now."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> VisionEmbeddingEntry | None:
        """The item's entry (now the most recently used one), or None; counts hit / miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(
        self, key: bytes, embeddings: torch.Tensor, deepstack: Sequence[torch.Tensor] = ()
    ) -> bool:
        """Store an item's outputs, evicting least recently used entries to make room.

        Returns False (storing nothing, evicting nothing) when the entry alone exceeds the
        capacity. A key already present is replaced (and becomes the most recent).
        """
        for level in deepstack:
            if level.shape[0] != embeddings.shape[0]:
                raise ValueError(
                    f"deepstack level has {level.shape[0]} rows, embeddings {embeddings.shape[0]}"
                )
        entry = VisionEmbeddingEntry(
            _owned(embeddings.detach()), tuple(_owned(t.detach()) for t in deepstack)
        )
        size = entry.nbytes
        if size > self.capacity_bytes:
            return False
        self.pop(key)
        while self._nbytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._nbytes -= old.nbytes
            self.evictions += 1
        self._entries[key] = entry
        self._nbytes += size
        return True

    def pop(self, key: bytes) -> VisionEmbeddingEntry | None:
        """Remove one entry (None when absent)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._nbytes -= entry.nbytes
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._nbytes = 0
