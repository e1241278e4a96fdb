"""Process-group setup of one engine: NCCL on CUDA, gloo on the CPU.

`init_distributed(mapping, ...)` joins the world (torchrun's env:// variables, or an explicit
`init_method` the test harness or the engine's spawner hands out) and makes the tp group;
`tp_group(mapping)` is what the collectives use.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ...mapping import Mapping

# tuple(global ranks) -> its group; the world group when the tp group is the whole world.
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    mapping: Mapping,
    device: torch.device,
    init_method: str = "env://",
    timeout_s: float = 600.0,
) -> None:
    """Join the process group of `mapping.world_size` ranks as `mapping.rank`.

    A no-op for a single-rank mapping (no torch.distributed at all on one GPU). Joining twice
    with another layout is an error: one process serves one engine.
    """
    if mapping.world_size == 1:
        return
    if dist.is_initialized():
        if dist.get_world_size() != mapping.world_size or dist.get_rank() != mapping.rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}; this engine wants rank {mapping.rank} of "
                f"{mapping.world_size}"
            )
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend=default_backend(device),
            init_method=init_method,
            world_size=mapping.world_size,
            rank=mapping.rank,
            timeout=timedelta(seconds=timeout_s),
        )
    ranks = tuple(mapping.tp_group)
    if ranks not in _GROUPS:
        # new_group is collective over the world: every rank creates every tp group.
        if mapping.tp_size == mapping.world_size:
            _GROUPS[ranks] = dist.group.WORLD  # type: ignore[assignment]
        else:
            for start in range(0, mapping.world_size, mapping.tp_size):
                group = tuple(range(start, start + mapping.tp_size))
                _GROUPS[group] = dist.new_group(list(group))


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def tp_group(mapping: Mapping) -> dist.ProcessGroup:
    """The tensor-parallel group of this rank (after `init_distributed`)."""
    group = _GROUPS.get(tuple(mapping.tp_group))
    if group is None:
        raise RuntimeError(
            f"no process group for tp ranks {mapping.tp_group}: call init_distributed(mapping, "
            "device) before building a tensor-parallel model"
        )
    return group


def destroy_distributed() -> None:
    """Leave the process group (engine shutdown); safe to call when never joined."""
    _GROUPS.clear()
    if is_initialized():
        dist.destroy_process_group()
