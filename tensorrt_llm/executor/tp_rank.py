"""A worker rank of a tensor-parallel engine, as its own process.

The engine process (rank 0, `tp_ranks.py`) starts one `python -m tensorrt_llm.executor.tp_rank`
per other rank and writes the startup payload, one pickle, to its stdin: the `EngineConfig`
with this rank's `Mapping` and the rendezvous address. As for the engine process itself, the
pipe stays open and its EOF means rank 0 is gone: the rank then exits (no orphan). It leaves
on rank 0's stop command otherwise (`tp_worker.run_tp_worker`).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading

logger = logging.getLogger(__name__)


def _exit_with_parent(fd: int) -> None:
    while os.read(fd, 4096):
        pass
    os._exit(1)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the engine stops
    config, init_method = pickle.load(sys.stdin.buffer)
    threading.Thread(
        target=_exit_with_parent, args=(sys.stdin.fileno(),), name="parent-watch", daemon=True
    ).start()
    level = os.environ.get("TRTLLM_ENGINE_LOG_LEVEL")
    if level is not None:
        logging.basicConfig(level=level)
    from .._torch.distributed import destroy_distributed, init_distributed
    from .._torch.pyexecutor.tp_worker import run_tp_worker

    init_distributed(config.mapping, config.device, init_method)
    try:
        run_tp_worker(config)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
