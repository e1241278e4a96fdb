"""The engine in its own process: `GenerationExecutorProxy` (front end), `worker` (engine
process), `ipc` (ZeroMQ sockets and the message codec, shared memory for large tensors)."""

from __future__ import annotations

__all__ = ["GenerationExecutorProxy"]


def __getattr__(name: str) -> object:
    # Lazy: importing the package must not pull in zmq or the executor for in-process users.
    if name == "GenerationExecutorProxy":
        from .proxy import GenerationExecutorProxy

        return GenerationExecutorProxy
    raise AttributeError(name)
