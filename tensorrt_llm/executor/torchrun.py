"""A tensor-parallel engine whose ranks torchrun started (one node or several).

`torchrun --nnodes N --nproc_per_node M script.py` (or `... -m tensorrt_llm.commands.serve`)
starts the same entry point N x M times with RANK, WORLD_SIZE, LOCAL_RANK (and
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set. With `tensor_parallel_size = WORLD_SIZE`:

- rank 0 runs as without torchrun (the front end, its engine process), except that the
  engine process starts no ranks: it joins the group torchrun's variables describe
  (`env://`, `TensorParallelRanks.start`);
- every other rank does not serve: `LLM(...)` builds its shard from the same arguments, joins
  the same group, runs rank 0's steps until rank 0 stops (`run_tp_worker`), then ends the
  process (SystemExit(0)), so nothing after the constructor runs there.

Rank r's GPU is `cuda:LOCAL_RANK`. The variables are ignored when tensor_parallel_size is 1
(a torchrun job of independent single-GPU engines). NOTE: a rank that dies is torchrun's to
handle: its agent stops the other ranks of the job (the watcher of `tp_ranks.py` only watches
ranks it started itself).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping as EnvMapping
from dataclasses import dataclass, replace
from typing import Any

from ..mapping import Mapping

logger = logging.getLogger(__name__)

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env(environ: EnvMapping[str, str] | None = None) -> TorchrunEnv | None:
    """The torchrun variables of this process; None unless RANK, WORLD_SIZE and LOCAL_RANK
    are all set (a partial set is a ValueError: a launcher half-configured)."""
    env = os.environ if environ is None else environ
    present = [name for name in _REQUIRED if name in env]
    if not present:
        return None
    if len(present) != len(_REQUIRED):
        missing = [name for name in _REQUIRED if name not in env]
        raise ValueError(f"torchrun variables {present} are set but not {missing}")
    try:
        rank, world, local = (int(env[name]) for name in _REQUIRED)
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError as exc:
        raise ValueError(f"torchrun variables must be integers: {exc}") from None
    if not (0 <= rank < world and 0 <= local < local_world <= world):
        raise ValueError(
            f"torchrun variables out of range: RANK={rank} WORLD_SIZE={world} "
            f"LOCAL_RANK={local} LOCAL_WORLD_SIZE={local_world}"
        )
    return TorchrunEnv(rank, world, local, local_world)


def torchrun_job(tensor_parallel_size: int) -> TorchrunEnv | None:
    """The torchrun job this engine's ranks are, or None (no torchrun, or one GPU).

    A job of another size is a ValueError: every process of it must be one of the ranks."""
    env = torchrun_env()
    if env is None or tensor_parallel_size == 1:
        return None
    if env.world_size != tensor_parallel_size:
        raise ValueError(
            f"torchrun started {env.world_size} processes (WORLD_SIZE) but "
            f"tensor_parallel_size={tensor_parallel_size}; they must be equal (one rank each)"
        )
    return env


def torchrun_mapping(tensor_parallel_size: int, env: TorchrunEnv, rank: int = 0) -> Mapping:
    """`rank` of the job's layout; a node's ranks are contiguous, as torchrun numbers them."""
    return Mapping(
        world_size=tensor_parallel_size,
        rank=rank,
        gpus_per_node=env.local_world_size,
        tp_size=tensor_parallel_size,
    )


def run_torchrun_worker(args: Any, env: TorchrunEnv) -> int:
    """Ranks 1.. of a torchrun job (from `LLM.__init__`): the engine shard of `args` (an
    `LlmArgs`, the same on every rank) on `cuda:LOCAL_RANK`, serving rank 0's steps until it
    stops; returns how many steps ran."""
    import torch

    from .._torch.distributed import destroy_distributed, init_distributed
    from .._torch.pyexecutor.tp_worker import run_tp_worker

    config = args.to_engine_config()
    mapping = replace(config.mapping, rank=env.rank)
    device = config.device
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    config = replace(config, mapping=mapping, device=device)
    logger.info("torchrun rank %d/%d: tp worker on %s", env.rank, env.world_size, device)
    init_distributed(mapping, device, "env://")
    try:
        return run_tp_worker(config)
    finally:
        destroy_distributed()
