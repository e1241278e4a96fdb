"""trtllm-serve with the engine in its own process: when that process dies, the request in
flight fails with a clear error and the server exits non-zero (so a supervisor restarts it)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from serve_helpers import spawn_server


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append((int(entry.name), cmdline))
    return out


def _engine_pid(server_pid: int) -> int:
    engines = [p for p, cmd in _children(server_pid) if "-m tensorrt_llm.executor.worker" in cmd]
    assert len(engines) == 1, _children(server_pid)
    return engines[0]


def test_engine_process_death_fails_requests_and_exits_nonzero() -> None:
    # 4000 tokens: seconds of demo decode, so the request is still running at the kill (480
    # once were done within the 1 s wait on a quiet machine).
    proc, base, model = spawn_server(["--executor_mode", "process", "--max_seq_len", "4096"])
    try:
        out: dict[str, Any] = {}

        def ask() -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "tell me a long story"}],
                "max_tokens": 4000,
                "ignore_eos": True,
            }
            try:
                r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
                out["status"], out["body"] = r.status_code, r.json()
            except httpx.HTTPError as exc:
                out["status"], out["body"] = "transport", repr(exc)

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(1.0)
        os.kill(_engine_pid(proc.pid), signal.SIGKILL)
        asker.join(30)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out["status"] == 500, out
    assert "engine process died" in out["body"]["error"]["message"]
    assert code not in (0, None)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped


def test_sigterm_leaves_no_engine_process() -> None:
    proc, _base, _model = spawn_server(["--executor_mode", "process", "--max_seq_len", "512"])
    try:
        engine = _engine_pid(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine), f"engine process {engine} outlived trtllm-serve"
