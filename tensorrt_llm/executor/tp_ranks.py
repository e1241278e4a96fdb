"""Rank 0's side of a tensor-parallel engine on one node: start the other ranks, watch them,
stop them.

`TensorParallelRanks.start(config)` launches ranks 1..N-1 (`tp_rank.py`, fresh interpreters
as the engine process itself is: no multiprocessing spawn) and joins the process group as
rank 0; `create_py_executor` then drives them. A rank that exits while the engine runs takes
the engine process down within `_WATCH_S` (its exit code and rank logged), which the front end
reports as an engine failure; `stop()` waits for the ranks after the executor's stop command
and kills what is left, so no rank outlives the engine. Under torchrun the ranks are its own:
none is started, rank 0 joins them through env:// (`torchrun.py`).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from typing import Any

import torch

from ..mapping import Mapping
from .torchrun import TorchrunEnv, torchrun_job

logger = logging.getLogger(__name__)

_WATCH_S = 0.5
_STOP_TIMEOUT_S = 30.0
_EXIT_RANK_DIED = 4


def rank_config(config: Any, rank: int) -> Any:
    """`config` for `rank`: its Mapping, and its own GPU of the node on CUDA."""
    mapping = replace(config.mapping, rank=rank)
    device = config.device
    if device.type == "cuda":
        device = torch.device("cuda", mapping.local_rank)
    return replace(config, mapping=mapping, device=device)


class TensorParallelRanks:
    """The worker ranks of this engine process (rank 0)."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], tmpdir: str | None) -> None:
        self.procs = procs
        self._tmpdir = tmpdir
        self._stopping = threading.Event()
        if procs:  # ranks torchrun started are its own to watch
            threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

    @classmethod
    def start(cls, config: Any) -> tuple[TensorParallelRanks, Any]:
        """Launch ranks 1.. and join the group as rank 0; returns (ranks, rank 0's config)."""
        from .._torch.distributed import init_distributed
        from .._torch.pyexecutor.tp_setup import check_model_shards

        check_model_shards(config)  # refusals come from here, not from a rank that died
        mapping: Mapping = config.mapping
        job = torchrun_job(mapping.tp_size)
        if job is not None:
            return cls._join_torchrun_job(config, job)
        if mapping.world_size > torch.cuda.device_count() and config.device.type == "cuda":
            raise ValueError(
                f"tensor_parallel_size={mapping.tp_size} needs {mapping.world_size} GPUs on "
                f"this node, {torch.cuda.device_count()} are visible"
            )
        tmpdir = tempfile.mkdtemp(prefix="trtllm-tp-")
        init_method = f"file://{os.path.join(tmpdir, 'rendezvous')}"
        procs = [_launch(rank_config(config, r), init_method) for r in range(1, mapping.world_size)]
        ranks = cls(procs, tmpdir)
        own = rank_config(config, 0)
        try:
            init_distributed(own.mapping, own.device, init_method)
        except BaseException:
            ranks.stop(timeout_s=0)
            raise
        return ranks, own

    @classmethod
    def _join_torchrun_job(cls, config: Any, job: TorchrunEnv) -> tuple[TensorParallelRanks, Any]:
        """The other ranks are torchrun's (they run `LLM(...)` as workers, torchrun.py):
        start none, join the group of its variables (env://) as rank 0."""
        from .._torch.distributed import init_distributed

        if job.rank != 0:
            raise ValueError(f"the engine process must be torchrun's rank 0, not {job.rank}")
        device = config.device
        if device.type == "cuda":
            if job.local_world_size > torch.cuda.device_count():
                raise ValueError(
                    f"torchrun starts {job.local_world_size} ranks on this node (one GPU each), "
                    f"{torch.cuda.device_count()} are visible"
                )
            device = torch.device("cuda", job.local_rank)
        own = replace(config, device=device)
        init_distributed(own.mapping, own.device, "env://")
        return cls([], None), own

    def _watch(self) -> None:
        while not self._stopping.wait(_WATCH_S):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is None or self._stopping.is_set():
                    continue
                logger.error(
                    "tensor-parallel rank %d (pid %d) exited with code %s; the engine stops",
                    rank,
                    proc.pid,
                    code,
                )
                self._kill_all()
                # NOTE: rank 0 may sit in a collective that waits for the dead rank: leave
                # now, and the front end fails every request with the engine's exit code.
                os._exit(_EXIT_RANK_DIED)

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """After the executor's stop command: wait for the ranks, then kill any left (at
        once with timeout_s=0: a startup that failed sends no stop command)."""
        self._stopping.set()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank pid %d did not stop; killing it", proc.pid)
        self._kill_all()
        from .._torch.distributed import destroy_distributed

        destroy_distributed()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass


def _launch(config: Any, init_method: str) -> subprocess.Popen[bytes]:
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    proc = subprocess.Popen(
        [sys.executable, *safe_path, "-m", "tensorrt_llm.executor.tp_rank"],
        stdin=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path)),
    )
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps((config, init_method), protocol=5))
    proc.stdin.flush()
    return proc
