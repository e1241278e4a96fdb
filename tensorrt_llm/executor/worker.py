"""The engine process: builds the PyExecutor and serves it over the IPC sockets.

The front end starts it as `python -m tensorrt_llm.executor.worker` (`proxy.py`) and writes
the startup payload, one pickle, to its stdin; the pipe stays open, and its EOF tells this
process that the front end is gone. No multiprocessing spawn: that re-imports the user's
`__main__` here, and a script that builds `LLM(...)` without a main guard would recurse.

Requests arrive as token ids plus preprocessed multimodal tensors (`protocol.RequestMsg`);
the engine never tokenizes prompts, decodes media or detokenizes outputs (stop strings are the
front end's: `llmapi/outputs.py`). NOTE: it loads the input processor (and so a tokenizer)
once, for the capacity probe's dummy prompts at startup.

The PyExecutor calls its callback once per request; the worker collects those responses and
sends ONE message per executor step (from `on_step`, which the loop calls after each
iteration), together with the step's stats snapshot.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import asdict
from typing import Any

import zmq

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
    response_to_tuple,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100


def _watch_parent(fd: int) -> None:
    """Exit when the front end disappears (SIGKILL, SIGTERM without cleanup): no orphans.

    The front end writes nothing after the payload and closes the pipe only once this
    process has exited, so EOF means its end was closed by the kernel: it died."""
    # os.read, not sys.stdin: a daemon thread blocked inside the buffered reader holds its
    # lock, and the interpreter's shutdown, which closes sys.stdin, then aborts.
    while os.read(fd, 4096):
        pass
    os._exit(1)


def _startup_error(exc: BaseException) -> tuple[str, bytes | None, str, str]:
    """(kind, the pickled exception if it pickles, its type name, message + traceback)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob: bytes | None = pickle.dumps(exc.with_traceback(None))
        pickle.loads(blob)
    except Exception:
        blob = None
    return MSG_ERROR, blob, type(exc).__name__ + ": " + str(exc), text


def _build(args: Any) -> tuple[Any, Any]:
    """(the executor, the other tensor-parallel ranks or None)."""
    from .._torch.pyexecutor.py_executor_creator import create_py_executor
    from ..inputs.registry import create_input_processor, load_tokenizer

    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
    processor = create_input_processor(
        args.model, tokenizer=tokenizer, trust_remote_code=args.trust_remote_code
    )
    config = args.to_engine_config()
    ranks = None
    if config.mapping.has_tp:  # this process is rank 0 and starts the others
        from .tp_ranks import TensorParallelRanks

        ranks, config = TensorParallelRanks.start(config)
    try:
        return create_py_executor(config, processor), ranks
    except BaseException:
        if ranks is not None:
            ranks.stop(timeout_s=0)
        raise


class _EngineWorker:
    """Owns the executor and the response socket of the engine process."""

    def __init__(self, executor: Any, responses: zmq.Socket) -> None:
        self.executor = executor
        self._responses = responses
        self._send_lock = threading.Lock()  # the loop thread and the main thread both send
        self._pending: list[tuple[Any, ...]] = []
        self._pending_lock = threading.Lock()
        self._last_stats: dict[str, Any] | None = None
        executor.on_step = self._flush

    def _on_response(self, response: Any) -> None:
        with self._pending_lock:
            self._pending.append(response_to_tuple(response))

    def _flush(self, stats: Any = None) -> None:
        """Send every response collected since the last flush, with the stats, as one message."""
        stats_dict = asdict(stats if stats is not None else self.executor.get_stats())
        with self._pending_lock:
            batch, self._pending = self._pending, []
        if not batch and stats_dict == self._last_stats:
            return
        self._last_stats = stats_dict
        self._send((MSG_STEP, batch, stats_dict))

    def _send(self, message: Any) -> None:
        with self._send_lock:
            self._responses.send(pickle.dumps(message, protocol=5))

    def info(self) -> EngineInfo:
        return EngineInfo.from_executor(self.executor, os.getpid())

    def handle(self, message: Any) -> bool:
        """Apply one command; False once the executor has stopped."""
        kind = message[0]
        if kind == MSG_REQUEST:
            self._enqueue(message[1])
        elif kind == MSG_CANCEL:
            self.executor.cancel_request(message[1])
        elif kind == MSG_SHUTDOWN:
            self.executor.shutdown(wait=message[1])
            self._flush()
            self._send((MSG_STOPPED, asdict(self.executor.get_stats())))
            return False
        return True

    def _enqueue(self, msg: RequestMsg) -> None:
        try:
            request = msg.to_llm_request()
            self.executor.enqueue_request(request, self._on_response)
        except (ValueError, TypeError, RuntimeError) as exc:
            from .._torch.pyexecutor.llm_request import ERROR_INVALID_INPUT, ERROR_SHUTTING_DOWN
            from .._torch.pyexecutor.py_executor import LlmResponse

            code = ERROR_SHUTTING_DOWN if isinstance(exc, RuntimeError) else ERROR_INVALID_INPUT
            response = LlmResponse(
                msg.request_id, [], True, "error", error=str(exc), error_code=code
            )
            self._on_response(response)
            self._flush()


def _serve(worker: _EngineWorker, requests: zmq.Socket) -> int:
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    while True:
        if not poller.poll(_POLL_MS):
            if not worker.executor.is_alive:
                logger.error("the executor loop died; the engine process exits")
                return 3
            worker._flush()  # NOTE: a safety net; responses normally leave from on_step
            continue
        if not worker.handle(ipc.recv(requests)):
            return 0


def worker_main(
    args: Any, request_address: str, response_address: str, parent_fd: int | None = None
) -> None:
    """Build the engine and serve it; `parent_fd` (a pipe) hits EOF when the front end dies."""
    # Ctrl-C reaches the whole process group; the front end decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _configure_logging()
    if parent_fd is not None:
        threading.Thread(
            target=_watch_parent, args=(parent_fd,), name="parent-watch", daemon=True
        ).start()
    context = zmq.Context()
    requests = ipc.make_socket(context, zmq.PULL, request_address, bind=False)
    responses = ipc.make_socket(context, zmq.PUSH, response_address, bind=False)
    code = 0
    ranks = None
    try:
        try:
            executor, ranks = _build(args)
        except BaseException as exc:  # reported to LLM(...) as the same exception
            responses.send(pickle.dumps(_startup_error(exc), protocol=5))
            code = 2
            return
        worker = _EngineWorker(executor, responses)
        responses.send(pickle.dumps((MSG_READY, worker.info()), protocol=5))
        code = _serve(worker, requests)
    finally:
        if ranks is not None:
            ranks.stop()  # the executor's shutdown told them to stop
        requests.close()
        # Give the last message (stopped / error) a moment to leave before the socket closes.
        responses.setsockopt(zmq.LINGER, 2000)
        responses.close()
        context.term()
        if code:
            os._exit(code)


def _configure_logging() -> None:
    """Log at the front end's level and in its format (proxy._log_settings), to stderr."""
    level = os.environ.get("TRTLLM_ENGINE_LOG_LEVEL")
    if level is None:
        return
    fmt = os.environ.get("TRTLLM_ENGINE_LOG_FORMAT", logging.BASIC_FORMAT)
    logging.basicConfig(level=level, format=fmt)


def main() -> None:
    """`python -m tensorrt_llm.executor.worker`: read the payload from stdin, then serve."""
    # Before the payload: unpickling it imports modules, and a Ctrl-C there must not kill us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # NOTE: the watcher reads the fd, past sys.stdin's buffer; fine, as nothing follows the pickle.
    args, request_address, response_address = pickle.load(sys.stdin.buffer)
    worker_main(args, request_address, response_address, sys.stdin.fileno())


if __name__ == "__main__":
    main()
