"""No engine process outlives its front end: garbage collection and SIGTERM of the parent."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorrt_llm import LLM
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

from .test_proxy import KWARGS, _alive

_PARENT = """
import sys
from tensorrt_llm import LLM
llm = LLM(sys.argv[1], executor_mode="process", max_batch_size=2, max_seq_len=256,
          kv_cache_max_tokens=1024, tokens_per_block=16)
print(llm._executor.pid, flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return get_or_build_demo_checkpoint("qwen2_vl")


def _wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_garbage_collected_llm_stops_its_engine(ckpt: Path) -> None:
    llm = LLM(str(ckpt), executor_mode="process", **KWARGS)
    pid = llm._executor.pid
    assert _alive(pid)
    del llm
    gc.collect()
    assert _wait_dead(pid, 5.0)


def test_sigterm_of_the_parent_leaves_no_engine(ckpt: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(ckpt)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        assert line.strip().isdigit(), f"the parent did not start its engine: {line!r}"
        child = int(line)
        assert _alive(child)
        os.kill(parent.pid, signal.SIGTERM)
        parent.wait(10)
        # The child sees its parent vanish (the parent ran no cleanup) and exits on its own.
        assert _wait_dead(child, 5.0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
