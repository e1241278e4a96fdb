"""IPC between the front end and the engine process: ZeroMQ sockets and the message codec.

A message is one pickle (protocol 5) frame plus its out-of-band buffers as further frames, so
numpy arrays and small tensors travel without an extra copy into the pickle stream. A tensor
bigger than `SHM_THRESHOLD_BYTES` travels through `multiprocessing.shared_memory` instead: the
sender copies it into a fresh segment and sends only the segment's name; the receiver copies it
out and unlinks the segment. The sender keeps the names it created (`Encoded.shm_names`) so it
can unlink what a receiver never read (the engine process died first): no segment outlives
its request in /dev/shm.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import threading
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np
import torch
import zmq

SHM_THRESHOLD_BYTES = 64 * 1024
# Segment names carry the creating pid, so a test (or an operator) can tell ours apart.
SHM_PREFIX = "trtllm_ipc_"
_shm_counter = itertools.count()
_shm_counter_lock = threading.Lock()


def shm_name_prefix(pid: int | None = None) -> str:
    return f"{SHM_PREFIX}{os.getpid() if pid is None else pid}_"


@dataclass
class Encoded:
    """One encoded message: the frames to send and the shared-memory segments it created."""

    frames: list[Any]
    shm_names: list[str] = field(default_factory=list)


def _tensor_from_buffer(buf: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not len(buf):
        return torch.empty(shape, dtype=dtype)  # from_numpy of an empty buffer has stride 0
    # Copied: the frame is read-only and is reused by ZeroMQ once the message is dropped.
    raw = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8).copy())
    return raw.view(dtype).reshape(shape)


def _tensor_from_shm(
    name: str, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    segment = shared_memory.SharedMemory(name=name)
    try:
        out = torch.empty(nbytes, dtype=torch.uint8)
        _copy_bytes(out, segment.buf, nbytes, to_buffer=False)
    finally:
        segment.close()
        segment.unlink()
    return out.view(dtype).reshape(shape)


def _copy_bytes(tensor: torch.Tensor, buf: Any, nbytes: int, to_buffer: bool) -> None:
    """Copy `nbytes` between a uint8 tensor and a shared-memory buffer.

    NOTE: a torch copy, not a memoryview slice assignment: torch drops the GIL while it copies
    (and takes the first-touch page faults of a fresh segment), so the server's other threads
    (the event loop, input preparation) keep running during a multi-megabyte copy.
    """
    view = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    try:
        if to_buffer:
            view.copy_(tensor)
        else:
            tensor.copy_(view)
    finally:
        del view  # close() refuses while a view of the buffer is alive


def _new_segment(nbytes: int) -> shared_memory.SharedMemory:
    with _shm_counter_lock:
        name = f"{shm_name_prefix()}{next(_shm_counter)}"
    segment = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    # The receiver unlinks it (and its attach registers it there); the creator's own
    # registration would make the resource tracker unlink it again, or warn, at exit.
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, buffers: list[Any], shm_names: list[str]) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._shm_names = shm_names

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        tensor = obj.detach().cpu().contiguous()
        shape = tuple(tensor.shape)
        flat = tensor.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        if nbytes <= SHM_THRESHOLD_BYTES:
            return _tensor_from_buffer, (pickle.PickleBuffer(flat.numpy()), tensor.dtype, shape)
        segment = _new_segment(nbytes)
        try:
            _copy_bytes(flat, segment.buf, nbytes, to_buffer=True)
        finally:
            segment.close()
        self._shm_names.append(segment.name)
        return _tensor_from_shm, (segment.name, nbytes, tensor.dtype, shape)


def encode(obj: Any) -> Encoded:
    """Frames of `obj`; tensors inline (small) or through shared memory (large)."""
    buffers: list[Any] = []
    names: list[str] = []
    stream = io.BytesIO()
    try:
        _Pickler(stream, buffers, names).dump(obj)
    except BaseException:
        unlink_segments(names)
        raise
    return Encoded([stream.getvalue(), *(b.raw() for b in buffers)], names)


def decode(frames: list[Any]) -> Any:
    """The object of `frames` (bytes, memoryviews or zmq.Frame); shared memory is read once."""
    views = [f.buffer if isinstance(f, zmq.Frame) else f for f in frames]
    return pickle.loads(views[0], buffers=views[1:])


def unlink_segments(names: list[str]) -> None:
    """Unlink segments that may still exist (a receiver that read one unlinked it already)."""
    for name in names:
        try:
            segment = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        segment.close()
        try:
            segment.unlink()
        except FileNotFoundError:
            pass


def send(socket: zmq.Socket, encoded: Encoded, flags: int = 0) -> None:
    socket.send_multipart(encoded.frames, flags=flags, copy=True)


def recv(socket: zmq.Socket) -> Any:
    return decode(socket.recv_multipart(copy=False))


def make_socket(context: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket
