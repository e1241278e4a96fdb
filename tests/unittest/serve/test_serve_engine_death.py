"""trtllm-serve with the engine in its own process: when that process dies, the request in
flight fails with a clear error and the server exits non-zero (so a supervisor restarts it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    engines = [
        p
        for p, cmd in _children(server_pid)
        if "spawn_main" in cmd and "resource_tracker" not in cmd
    ]
    assert len(engines) == 1, _children(server_pid)
    return engines[0]


def test_engine_process_death_fails_requests_and_exits_nonzero() -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "tensorrt_llm.commands.serve", "--demo", "--device", "cpu"]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--executor_mode", "process"]
    cmd += ["--max_seq_len", "512", "--log_level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
        out: dict[str, Any] = {}

        def ask() -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "tell me a long story"}],
                "max_tokens": 480,
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
