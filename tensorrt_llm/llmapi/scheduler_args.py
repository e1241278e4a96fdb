"""TensorRT-LLM's `SchedulerConfig`: which capacity policy admits requests.

`capacity_scheduler_policy`:
- `MAX_UTILIZATION` (ours by default): KV blocks are claimed as sequences grow; when the pool
  runs out the least important running request is preempted and recomputed later. Long
  `max_tokens` (thinking traces) cost nothing until they are generated.
- `GUARANTEED_NO_EVICT` (TensorRT-LLM's default): a request is admitted only when the blocks for
  its whole prompt + max_tokens fit beside everything already admitted, so nothing is ever
  preempted; a large max_tokens caps concurrency whatever the outputs' real lengths.

The default differs from TensorRT-LLM's on purpose: serving thinking models at capacity needs
on-demand blocks. `context_chunking_policy` and `dynamic_batch_config` have one behaviour here
(first come first served; static limits), so other values are an error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class CapacitySchedulerPolicy(str, enum.Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"


class ContextChunkingPolicy(str, enum.Enum):
    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"


@dataclass(frozen=True)
class SchedulerConfig:
    """`LLM(scheduler_config=SchedulerConfig(...))`, or a dict of these fields."""

    capacity_scheduler_policy: CapacitySchedulerPolicy | str = (
        CapacitySchedulerPolicy.MAX_UTILIZATION
    )
    context_chunking_policy: ContextChunkingPolicy | str | None = None
    dynamic_batch_config: None = None

    def __post_init__(self) -> None:
        policy = _member(
            CapacitySchedulerPolicy, self.capacity_scheduler_policy, "capacity_scheduler_policy"
        )
        object.__setattr__(self, "capacity_scheduler_policy", policy)
        if self.context_chunking_policy is not None:
            chunking = _member(
                ContextChunkingPolicy, self.context_chunking_policy, "context_chunking_policy"
            )
            object.__setattr__(self, "context_chunking_policy", chunking)
        if self.dynamic_batch_config is not None:
            raise ValueError(
                "scheduler_config.dynamic_batch_config is not supported: the batch limits are "
                "max_batch_size and max_num_tokens"
            )


def _member(enum_type: type[enum.Enum], value: Any, name: str) -> Any:
    """The enum member named by `value` (a member or its name)."""
    if isinstance(value, enum_type):
        return value
    names = [m.name for m in enum_type]
    if isinstance(value, str) and value.upper() in names:
        return enum_type[value.upper()]
    raise ValueError(f"scheduler_config.{name} must be one of {names}, got {value!r}")


def resolve_scheduler_config(value: Any) -> SchedulerConfig:
    """`LlmArgs.scheduler_config` (None, a `SchedulerConfig` or a dict) as a checked config."""
    if value is None:
        return SchedulerConfig()
    if isinstance(value, SchedulerConfig):
        return value
    if isinstance(value, dict):
        known = ("capacity_scheduler_policy", "context_chunking_policy", "dynamic_batch_config")
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(
                f"unknown scheduler_config field(s) {unknown}; supported: {list(known)}"
            )
        return SchedulerConfig(**value)
    raise ValueError(f"scheduler_config must be a SchedulerConfig, a dict or None, got {value!r}")
