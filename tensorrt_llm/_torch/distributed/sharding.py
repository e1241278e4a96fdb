"""Which slice of a checkpoint tensor one tensor-parallel rank holds.

The weight loader reads only that slice (`TensorShard.take` indexes a safetensors slice
lazily, or a loaded tensor), and the modules build their parameters at the slice's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorShard:
    """Rows `[start, start + length)` of dimension `dim`, zero-padded to `padded` rows (a
    vocab shard of the last rank may hold fewer real rows than its parameter)."""

    dim: int
    start: int
    length: int
    padded: int | None = None

    @property
    def size(self) -> int:
        return self.length if self.padded is None else self.padded

    def take(self, source: Any) -> torch.Tensor:
        """This rank's part of `source` (a tensor, or anything indexable like one with a
        `shape`: `LazyTensor` reads only the slice from the file)."""
        full = int(source.shape[self.dim])
        if self.start + self.length > full:
            raise ValueError(
                f"shard rows [{self.start}, {self.start + self.length}) of dim {self.dim} "
                f"outside a tensor of {full}"
            )
        index = tuple([slice(None)] * self.dim + [slice(self.start, self.start + self.length)])
        part = source[index]
        if not isinstance(part, torch.Tensor):
            part = torch.as_tensor(part)
        if self.padded is not None and self.padded > self.length:
            pad_shape = list(part.shape)
            pad_shape[self.dim] = self.padded - self.length
            part = torch.cat([part, part.new_zeros(pad_shape)], dim=self.dim)
        return part


@dataclass(frozen=True)
class MultiRangeShard:
    """Several row ranges `(start, length)` of dimension `dim`, read one by one and joined in
    order: a rank's rows of a checkpoint tensor that packs several head groups back to back
    (Gated DeltaNet's `in_proj_qkv` and conv1d: this rank's q, then k, then v channels)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return sum(n for _, n in self.ranges)

    @property
    def size(self) -> int:
        return self.length

    def take(self, source: Any) -> torch.Tensor:
        """This rank's rows of `source`; each range is read lazily (`TensorShard.take`)."""
        parts = [TensorShard(self.dim, start, n).take(source) for start, n in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


# What a parameter's `tp_shards` may hold for one checkpoint part.
AnyShard = TensorShard | MultiRangeShard


def column_shard(size: int, tp_size: int, tp_rank: int, what: str, dim: int = 0) -> TensorShard:
    """An even split of `size` rows (heads, channels) over the ranks; uneven is an error."""
    if size % tp_size:
        raise ValueError(f"{what}={size} is not divisible by tensor_parallel_size={tp_size}")
    per_rank = size // tp_size
    return TensorShard(dim, tp_rank * per_rank, per_rank)


def kv_head_shard(
    num_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int
) -> tuple[TensorShard, int]:
    """(rows of k or v this rank holds, its kv-head count). With fewer kv heads than ranks
    each head is replicated on `tp_size // num_kv_heads` ranks: rank r holds the head its
    query heads read, `r // (tp_size // num_kv_heads)`."""
    if num_kv_heads >= tp_size:
        shard = column_shard(num_kv_heads, tp_size, tp_rank, "num_key_value_heads")
        heads = shard.length
    else:
        if tp_size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must be a multiple of "
                f"num_key_value_heads={num_kv_heads} when it is larger"
            )
        heads = 1
        shard = TensorShard(0, tp_rank // (tp_size // num_kv_heads), 1)
    return TensorShard(0, shard.start * head_dim, heads * head_dim), heads


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> TensorShard:
    """Rows `[r * ceil(V / tp), ...)` of the vocabulary, the last shard padded with zeros."""
    per_rank = -(-vocab_size // tp_size)
    start = min(tp_rank * per_rank, vocab_size)
    length = min(per_rank, vocab_size - start)
    return TensorShard(0, start, length, padded=per_rank)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds (and caches): its share, or one replicated head."""
    return max(1, num_kv_heads // tp_size)
