"""The torchrun entry: the same script started as 2 processes with torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set by hand, gloo on the CPU). Rank 0 serves
and its greedy tokens equal a TP=1 engine's; rank 1 runs the worker loop inside `LLM(...)`
and exits 0 without running the rest of the script. Bounded in time; no process is left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_script import generate

from tensorrt_llm.executor.torchrun import torchrun_env, torchrun_job
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

SCRIPT = Path(__file__).with_name("torchrun_script.py")
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(rank: int, port: int, ckpt: Path) -> subprocess.Popen[str]:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path),
    )
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(ckpt), "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_torchrun_ranks_generate_as_tp1(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    reference = generate(str(ckpt), 1)
    port = _free_port()
    procs = [_launch(rank, port, ckpt) for rank in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    lines = [line for line in outputs[0].splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, outputs[0]
    assert json.loads(lines[0].removeprefix("TOKENS ")) == reference
    assert "TOKENS " not in outputs[1]  # rank 1 ended inside LLM(...)


def test_torchrun_variables() -> None:
    assert torchrun_env({}) is None
    env = torchrun_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert env is not None and (env.rank, env.local_rank, env.local_world_size) == (3, 1, 2)
    with pytest.raises(ValueError, match="not \\['LOCAL_RANK'\\]"):
        torchrun_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="out of range"):
        torchrun_env({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_torchrun_job_must_match_the_tp_size(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    assert torchrun_job(1) is None  # independent single-GPU engines: ignored
    assert torchrun_job(4) is not None
    with pytest.raises(ValueError, match="WORLD_SIZE.*tensor_parallel_size=2"):
        torchrun_job(2)
