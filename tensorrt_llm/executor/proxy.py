"""GenerationExecutorProxy: the front end's stand-in for PyExecutor, the engine in a child process.

`LLM(...)` builds one (executor_mode="process", the default). The child (`python -m
tensorrt_llm.executor.worker`, see `worker.py`) builds and runs the PyExecutor; this object
offers the PyExecutor methods that `LLM` and the server use (enqueue_request, cancel_request,
shutdown, is_alive, get_stats, why_never_fits, max_seq_len, vocab_size, pid). Callbacks
get the same `LlmResponse` objects as in process, called from one receiver thread of this
process.

Failure model: the child dying (crash, kill -9) is seen by the receiver within one poll
interval; every pending request then fails with "engine process died (exit code N)" and
`is_alive` turns False. shutdown(), garbage collection and interpreter exit stop the child;
the child exits on its own when this process disappears (its stdin pipe hits EOF). The child
is a fresh interpreter, not a multiprocessing spawn: the user's `__main__` is never re-imported,
so a script needs no `if __name__ == "__main__":` guard. It shares this process group (Ctrl-C
reaches it, and it ignores SIGINT: the front end decides when it stops) and this sys.path.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from .._torch.pyexecutor.llm_request import ERROR_ENGINE, ERROR_SHUTTING_DOWN, LlmRequest
from .._torch.pyexecutor.py_executor import (
    SHUTDOWN_ERROR,
    ExecutorStats,
    LlmResponse,
    PyExecutor,
    deliver_response,
)
from .._torch.pyexecutor.scheduler import SimpleScheduler
from . import ipc
from .protocol import (
    MSG_CANCEL,
    MSG_ERROR,
    MSG_READY,
    MSG_REQUEST,
    MSG_SHUTDOWN,
    MSG_STEP,
    MSG_STOPPED,
    EngineInfo,
    RequestMsg,
    response_from_tuple,
)

logger = logging.getLogger(__name__)
# How the engine child learns the front end's logging (worker.py reads them).
LOG_LEVEL_ENV = "TRTLLM_ENGINE_LOG_LEVEL"
LOG_FORMAT_ENV = "TRTLLM_ENGINE_LOG_FORMAT"

ResponseCallback = Callable[[LlmResponse], None]
_POLL_MS = 50
_SEND_TIMEOUT_S = 30.0
_JOIN_TIMEOUT_S = 10.0


class EngineProcessError(RuntimeError):
    """The engine process died or could not start."""


@dataclass
class _Pending:
    callback: ResponseCallback | None
    shm_names: list[str]


@dataclass
class _Limits:
    """What `PyExecutor.why_never_fits` reads, rebuilt from the engine's startup report."""

    max_seq_len: int
    scheduler: SimpleScheduler


def _wait(process: subprocess.Popen[bytes], timeout: float) -> bool:
    """True once the child has exited (and is reaped), False if it outlives `timeout`."""
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _stop_child(process: subprocess.Popen[bytes], tmpdir: str, stopping: threading.Event) -> None:
    """Last-resort cleanup (garbage collection, interpreter exit): no child, no socket files."""
    stopping.set()  # the receiver must not report the exit this causes as a crash
    if process.poll() is None:
        process.terminate()
        if not _wait(process, 2.0):
            process.kill()
            _wait(process, 2.0)
    # Closed only now: EOF on its stdin is how a live child learns that the front end died.
    if process.stdin is not None:
        try:
            process.stdin.close()
        except OSError:
            pass  # the child exited with unread data in the pipe
    shutil.rmtree(tmpdir, ignore_errors=True)


def _child_command() -> list[str]:
    # -P (3.11+): `-m` would put the cwd first on sys.path, and a tensorrt_llm checkout there
    # would shadow the one this process imported; PYTHONPATH alone then decides (_child_env).
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "tensorrt_llm.executor.worker"]


def _child_env() -> dict[str, str]:
    """This environment, with PYTHONPATH = this sys.path: the child imports the same packages,
    including entries added at run time (a script's sys.path edits, pytest's rootdir)."""
    env = dict(os.environ)
    # '' is the cwd of `python -c` or a REPL; the child shares the cwd but not that meaning.
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    env.update(_log_settings())
    return env


def _log_settings() -> dict[str, str]:
    """This process's root log level and format, for the engine child to log as it does
    (trtllm-serve's --log_level and format reach the engine's startup lines too)."""
    root = logging.getLogger()
    settings = {LOG_LEVEL_ENV: logging.getLevelName(root.getEffectiveLevel())}
    formatter = next((h.formatter for h in root.handlers if h.formatter is not None), None)
    fmt = getattr(formatter, "_fmt", None)
    if isinstance(fmt, str):
        settings[LOG_FORMAT_ENV] = fmt
    return settings


def _start_child(payload: bytes) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        _child_command(),
        stdin=subprocess.PIPE,
        env=_child_env(),
        start_new_session=False,  # one process group: a terminal's Ctrl-C reaches both
    )
    assert process.stdin is not None
    try:
        process.stdin.write(payload)
        process.stdin.flush()
    except BrokenPipeError:
        pass  # it died before reading: its exit code is reported by _await_ready
    return process


def _death_message(code: int) -> str:
    return f"engine process died (exit code {code})"


def _receive_loop(ref: weakref.ref[GenerationExecutorProxy]) -> None:
    # A weak reference: the thread must not keep an unreachable proxy (and its child) alive.
    while True:
        proxy = ref()
        if proxy is None or not proxy._receive_once():
            return
        del proxy


class GenerationExecutorProxy:
    """Starts the engine process and forwards requests and responses (see module docstring)."""

    def __init__(self, args: Any) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="trtllm-ipc-")
        self._context = zmq.Context()
        request_addr = f"ipc://{Path(self._tmpdir) / 'requests'}"
        response_addr = f"ipc://{Path(self._tmpdir) / 'responses'}"
        self._requests = ipc.make_socket(self._context, zmq.PUSH, request_addr, bind=True)
        self._responses = ipc.make_socket(self._context, zmq.PULL, response_addr, bind=True)
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._closed = False
        self._dead_message: str | None = None
        self._stopped = threading.Event()
        self._stats = ExecutorStats()
        self.responses: queue.Queue[LlmResponse] = queue.Queue()  # callback-less requests
        payload = pickle.dumps((args, request_addr, response_addr), protocol=5)
        self._process = _start_child(payload)
        self._stopping = threading.Event()  # set once we stop the child ourselves
        self._finalizer = weakref.finalize(
            self, _stop_child, self._process, self._tmpdir, self._stopping
        )
        try:
            self.info = self._await_ready()
        except BaseException:
            self._close_transport()
            raise
        self._stats = ExecutorStats(**self.info.stats)
        self.max_seq_len: int = self.info.max_seq_len
        self.vocab_size: int = self.info.vocab_size
        self._limits = _Limits(
            self.info.max_seq_len,
            SimpleScheduler(
                self.info.max_batch_size,
                self.info.max_num_tokens,
                self.info.enable_chunked_prefill,
                self.info.kv_limits,  # type: ignore[arg-type]
                None,  # type: ignore[arg-type]
            ),
        )
        self._receiver = threading.Thread(
            target=_receive_loop, args=(weakref.ref(self),), name="EngineProxyRecv", daemon=True
        )
        self._receiver.start()

    # ---- startup -------------------------------------------------------------------------------
    def _await_ready(self) -> EngineInfo:
        """Wait for the engine's report; re-raise its startup error here (same type/message)."""
        while not self._responses.poll(_POLL_MS):
            code = self._process.poll()
            if code is not None:
                raise EngineProcessError(f"engine process died during startup (exit code {code})")
        message = pickle.loads(self._responses.recv())
        if message[0] == MSG_READY:
            return message[1]
        assert message[0] == MSG_ERROR
        _, blob, summary, text = message
        _wait(self._process, _JOIN_TIMEOUT_S)
        exc = pickle.loads(blob) if blob is not None else EngineProcessError(summary)
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised in the engine process:\n{text}")
        raise exc

    # ---- PyExecutor API ------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def is_alive(self) -> bool:
        return not self._closed and self._dead_message is None and self._process.poll() is None

    def get_stats(self) -> ExecutorStats:
        return ExecutorStats(**vars(self._stats))

    def why_never_fits(self, request: LlmRequest) -> str | None:
        # NOTE: the engine's own rule on its reported sizes, so the messages match in process.
        return PyExecutor.why_never_fits(self._limits, request)  # type: ignore[arg-type]

    def enqueue_request(
        self, request: LlmRequest, callback: ResponseCallback | None = None
    ) -> None:
        if self._closed:
            raise RuntimeError("the executor is shut down; no new requests are accepted")
        gone = self._gone_message()
        if gone is not None:
            raise RuntimeError(gone)
        message = RequestMsg.from_llm_request(request, self.info.pixel_dtype)
        encoded = ipc.encode((MSG_REQUEST, message))
        with self._pending_lock:
            self._pending[request.request_id] = _Pending(callback, encoded.shm_names)
        try:
            self._send(encoded)
        except BaseException:
            with self._pending_lock:
                self._pending.pop(request.request_id, None)
            ipc.unlink_segments(encoded.shm_names)
            raise

    def cancel_request(self, request_id: int) -> None:
        if self.is_alive:
            try:
                self._send(ipc.encode((MSG_CANCEL, request_id)))
            except RuntimeError:
                pass  # the engine is gone: the death handler fails the request

    def _gone_message(self) -> str | None:
        """Why the engine takes no requests, or None while it runs.

        The child can have exited before the receiver thread (polling every _POLL_MS) noticed:
        the caller then gets the same message the pending requests are about to get.
        """
        if self._dead_message is not None:
            return self._dead_message
        code = self._process.poll()
        return None if code is None else _death_message(code)

    def _send(self, encoded: ipc.Encoded) -> None:
        """Send without blocking forever: a dead engine leaves PUSH with no peer."""
        waited = 0.0
        with self._send_lock:
            while True:
                try:
                    ipc.send(self._requests, encoded, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    gone = self._gone_message()
                    if gone is not None:
                        raise RuntimeError(gone) from None
                    if waited > _SEND_TIMEOUT_S:
                        raise RuntimeError("engine process does not take requests") from None
                    self._requests.poll(_POLL_MS, zmq.POLLOUT)
                    waited += _POLL_MS / 1000

    # ---- receiver thread -----------------------------------------------------------------------
    def _receive_once(self) -> bool:
        """Handle one message or one poll timeout; False when the thread should end."""
        if self._responses.poll(_POLL_MS):
            message = pickle.loads(self._responses.recv())
            if message[0] == MSG_STEP:
                self._on_step(message[1], message[2])
            elif message[0] == MSG_STOPPED:
                self._stats = ExecutorStats(**message[1])
                self._stopped.set()
                return False
            return True
        code = self._process.poll()
        if code is None:
            return True
        self._on_death(code)  # NOTE: -N when signal N killed it
        return False

    def _on_step(self, batch: list[tuple[Any, ...]], stats: dict[str, Any]) -> None:
        # Stats first: a caller woken by a final response reads the state after that step.
        self._stats = ExecutorStats(**stats)
        for item in batch:
            response = response_from_tuple(item)
            with self._pending_lock:
                if response.finished:
                    pending = self._pending.pop(response.request_id, None)
                else:
                    pending = self._pending.get(response.request_id)
            if pending is None:
                continue
            if response.finished:
                ipc.unlink_segments(pending.shm_names)
            self._deliver(pending.callback, response)

    def _deliver(self, callback: ResponseCallback | None, response: LlmResponse) -> None:
        deliver_response(callback, response, self.responses)

    def _on_death(self, code: int) -> None:
        if self._closed or self._stopping.is_set():
            self._fail_pending(SHUTDOWN_ERROR, ERROR_SHUTTING_DOWN)
            return
        self._dead_message = _death_message(code)
        logger.error("%s; failing %d pending requests", self._dead_message, len(self._pending))
        self._fail_pending(self._dead_message, ERROR_ENGINE)

    def _fail_pending(self, message: str, code: str) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for rid, entry in pending.items():
            ipc.unlink_segments(entry.shm_names)
            self._deliver(
                entry.callback,
                LlmResponse(rid, [], True, "error", error=message, error_code=code),
            )

    # ---- lifetime ------------------------------------------------------------------------------
    def shutdown(self, wait: bool = True) -> None:
        """Stop the engine. wait=True lets in-flight requests finish first; wait=False fails
        them. Blocks until the engine process has exited. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._process.poll() is None and self._dead_message is None:
            try:
                self._send(ipc.encode((MSG_SHUTDOWN, wait)))
            except RuntimeError:
                pass
            # Unbounded with wait=True (requests finish first) while the engine lives.
            while not self._stopped.wait(0.1) and self._process.poll() is None:
                pass
        if threading.current_thread() is not getattr(self, "_receiver", None):
            self._receiver.join(_JOIN_TIMEOUT_S)
        _wait(self._process, _JOIN_TIMEOUT_S)
        self._fail_pending(SHUTDOWN_ERROR, ERROR_SHUTTING_DOWN)
        self._close_transport()

    def _close_transport(self) -> None:
        self._closed = True
        self._finalizer()  # _stop_child, once: a later collection or exit finds nothing to do
        self._requests.close()
        self._responses.close()
        self._context.term()
