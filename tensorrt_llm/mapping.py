"""Mapping: how the ranks of one engine divide the model (TensorRT-LLM's name and fields).

One engine runs on `world_size = tp_size * pp_size` ranks. Tensor parallelism splits every
decoder layer across the `tp_size` ranks of a group; the MoE experts are split over
`moe_ep_size` ranks (expert parallelism) inside that group. Only `pp_size == 1` is built.

NOTE: frozen and normalised once (`moe_ep_size` -1 resolves to `tp_size`), like every config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    """Rank layout of one engine. The default is the single-GPU engine."""

    world_size: int = 1
    rank: int = 0
    gpus_per_node: int = 8
    tp_size: int = 1
    pp_size: int = 1
    # Experts split over this many ranks of the tp group (-1: tp_size, upstream's default).
    moe_ep_size: int = -1

    def __post_init__(self) -> None:
        for name in ("world_size", "gpus_per_node", "tp_size", "pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Mapping.{name} must be an int >= 1, got {value!r}")
        if self.pp_size != 1:
            raise ValueError(
                f"Mapping.pp_size={self.pp_size}: pipeline parallelism is not supported"
            )
        if self.world_size != self.tp_size * self.pp_size:
            raise ValueError(
                f"Mapping.world_size={self.world_size} must equal tp_size * pp_size "
                f"= {self.tp_size * self.pp_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mapping.rank={self.rank} outside [0, {self.world_size})")
        if self.moe_ep_size == -1:
            object.__setattr__(self, "moe_ep_size", self.tp_size)
        if self.moe_ep_size < 1 or self.tp_size % self.moe_ep_size:
            raise ValueError(
                f"Mapping.moe_ep_size={self.moe_ep_size} must divide tp_size={self.tp_size}"
            )

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def has_tp(self) -> bool:
        """More than one rank per layer: the modules shard and reduce (never on one GPU)."""
        return self.tp_size > 1

    @property
    def local_rank(self) -> int:
        """The rank's device index on its node."""
        return self.rank % self.gpus_per_node

    @property
    def is_first_rank(self) -> bool:
        """Rank 0 owns the scheduler and the responses."""
        return self.rank == 0

    @property
    def tp_group(self) -> list[int]:
        """Global ranks of this rank's tensor-parallel group."""
        start = self.rank - self.tp_rank
        return list(range(start, start + self.tp_size))
