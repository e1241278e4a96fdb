"""Coalesced cross-thread wake-ups for asyncio consumers.

Each `call_soon_threadsafe` writes a byte to the event loop's self-pipe. With one wake-up per
request per step, a step at concurrency 128 costs 128 syscalls on the executor thread. A waker
collects the events to set and schedules ONE callback per loop until that callback has run.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

_WAKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = (
    weakref.WeakKeyDictionary()
)
_WAKERS_LOCK = threading.Lock()


class LoopWaker:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._events: list[asyncio.Event] = []
        self._scheduled = False

    def set_soon(self, event: asyncio.Event) -> None:
        """Set `event` on the loop thread soon; safe from any thread."""
        with self._lock:
            self._events.append(event)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # loop closed: nobody is waiting there any more
            with self._lock:
                self._events.clear()
                self._scheduled = False

    def _flush(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            self._scheduled = False
        for event in events:
            event.set()


def waker_for(loop: asyncio.AbstractEventLoop) -> LoopWaker:
    with _WAKERS_LOCK:
        waker = _WAKERS.get(loop)
        if waker is None:
            waker = _WAKERS[loop] = LoopWaker(loop)
        return waker
