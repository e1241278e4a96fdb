"""`trtllm-serve` as a child of `trtllm-bench --served`: start, wait for /health, stop.

The child runs in its own session (process group), so a stop can reach whatever it spawned
(the engine process) even when the server itself has to be killed, and a Ctrl-C meant for the
benchmark does not race the benchmark's own orderly stop. On Linux the child also gets SIGTERM
if the benchmark dies without running its cleanup.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .sse_client import get_json

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM the child when the benchmark process dies."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # no libc by that name: the orderly stop still runs


SERVE_COMMAND = (sys.executable, "-m", "tensorrt_llm.commands.serve")


class ServerProcess:
    """One `trtllm-serve` child on 127.0.0.1; its output goes to `log_path`.

    `command` replaces the trtllm-serve command line (tests); --host and --port still follow.
    """

    def __init__(
        self,
        serve_flags: list[str],
        log_path: Path,
        host: str = "127.0.0.1",
        command: tuple[str, ...] = SERVE_COMMAND,
    ) -> None:
        self.host = host
        self.port = free_port(host)
        self.log_path = log_path
        argv = [*command, *serve_flags, "--host", host, "--port", str(self.port)]
        self.argv = argv
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        """Poll /health until it answers 200; raise if the child exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"trtllm-serve exited with code {code} before it was ready; its log "
                    f"({self.log_path}) ends with:\n{self.log_tail()}"
                )
            try:
                if get_json(self.host, self.port, "/health", timeout=2.0) is not None:
                    return
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"trtllm-serve was not ready within {timeout:g} s; its log "
                    f"({self.log_path}) ends with:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT (the server's graceful shutdown), then SIGKILL of its whole process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # NOTE: even after a clean exit, anything the server left in its group goes too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already empty
        return self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
