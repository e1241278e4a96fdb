"""Tensor-parallel layouts of the linear layers (TensorRT-LLM's `TensorParallelMode`).

COLUMN splits the output features (each fused part on its own: q, k, v or gate, up), so a
rank computes its heads / channels from the full input. ROW splits the input features: each
rank's output is a partial sum, all-reduced once (o_proj, down_proj: one all-reduce per
sub-layer). `shard_linear` turns the full sizes into one rank's sizes and the checkpoint
slices the weight loader reads (`Linear.tp_shards`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ...mapping import Mapping
from ..distributed import AnyShard, column_shard

# parameter name ("weight", "bias") -> one shard per checkpoint part (None: the whole part)
ParamShards = dict[str, tuple[AnyShard | None, ...]]


class TensorParallelMode(str, enum.Enum):
    COLUMN = "column"
    ROW = "row"


@dataclass(frozen=True)
class LinearShards:
    """One rank's view of a tensor-parallel Linear."""

    in_features: int
    output_splits: tuple[int, ...]
    tp_shards: ParamShards
    reduce_output: bool


def shard_linear(
    in_features: int,
    output_splits: Sequence[int],
    mode: TensorParallelMode,
    mapping: Mapping,
    output_shards: Sequence[AnyShard] | None = None,
) -> LinearShards:
    """Per-rank sizes and checkpoint slices. `output_shards` (COLUMN only) overrides the even
    split of each output part (replicated kv heads: `kv_head_shard`)."""
    tp, rank = mapping.tp_size, mapping.tp_rank
    if mode == TensorParallelMode.COLUMN:
        if output_shards is None:
            output_shards = [
                column_shard(n, tp, rank, f"output part {i} of a column-parallel Linear")
                for i, n in enumerate(output_splits)
            ]
        if len(output_shards) != len(output_splits):
            raise ValueError(f"{len(output_shards)} output shards for splits {output_splits}")
        shards = tuple(output_shards)
        return LinearShards(
            in_features,
            tuple(s.length for s in shards),
            {"weight": shards, "bias": shards},
            reduce_output=False,
        )
    if output_shards is not None:
        raise ValueError("output_shards is for column-parallel Linears only")
    cols = column_shard(in_features, tp, rank, "in_features of a row-parallel Linear", dim=1)
    # The bias is added once, after the reduce: every rank holds all of it.
    return LinearShards(
        cols.length,
        tuple(output_splits),
        {"weight": (cols,) * len(output_splits), "bias": (None,) * len(output_splits)},
        reduce_output=True,
    )
