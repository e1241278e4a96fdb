"""Run one function on N gloo ranks (spawned processes) with a bounded wait.

`spawn_ranks(body, world_size, *args)` calls `body(mapping, *args)` on every rank after
`init_distributed` (a file:// rendezvous in a fresh temp dir; gloo, or NCCL on GPU r) and
returns each rank's result in rank order. A rank that raises, exits or outlives `timeout_s`
fails the call; every process is killed before it returns, so a test never leaves one behind.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from tensorrt_llm._torch.distributed import destroy_distributed, init_distributed
from tensorrt_llm.mapping import Mapping


def _rank_main(
    body: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    results: Any,
    args: tuple[Any, ...],
    device_type: str,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        mapping = Mapping(world_size=world_size, rank=rank, tp_size=world_size)
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        init_distributed(mapping, device, init_method, timeout_s=60)
        try:
            # As bytes: a tensor put on the queue as is would be shared through a handle
            # that dies with this process.
            buffer = io.BytesIO()
            torch.save(body(mapping, *args), buffer)
            results.put((rank, "ok", buffer.getvalue()))
        finally:
            destroy_distributed()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))


def spawn_ranks(
    body: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    device_type: str = "cpu",
) -> list[Any]:
    """`device_type="cuda"`: rank r on GPU r, NCCL."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(body, rank, world_size, init_method, results, args, device_type),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            while len(out) < world_size:
                try:
                    rank, status, value = results.get(timeout=timeout_s)
                except queue.Empty:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(out))} gave no result "
                        f"within {timeout_s}s"
                    ) from None
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]
