"""torch.distributed for the engine: process groups (NCCL on CUDA, gloo on CPU), the
collectives the tensor-parallel modules call, and how a checkpoint tensor is sharded.

NOTE: every collective returns its input untouched when `mapping.tp_size == 1`, and the
modules only call them when they were built with `Mapping.has_tp`: the single-GPU engine does
no extra work per step.
"""

from .ops import all_gather, all_reduce, all_reduce_max, min_over_ranks
from .process_group import destroy_distributed, init_distributed, is_initialized, tp_group
from .sharding import (
    AnyShard,
    MultiRangeShard,
    TensorShard,
    column_shard,
    kv_head_shard,
    kv_heads_per_rank,
    vocab_shard,
)

__all__ = [
    "AnyShard",
    "MultiRangeShard",
    "TensorShard",
    "all_gather",
    "all_reduce",
    "all_reduce_max",
    "column_shard",
    "destroy_distributed",
    "init_distributed",
    "is_initialized",
    "kv_head_shard",
    "kv_heads_per_rank",
    "min_over_ranks",
    "tp_group",
    "vocab_shard",
]
