"""The HTTP server's life: slow-header protection, and a shutdown that answers everyone.

Shutdown (SIGINT/SIGTERM, or `server.should_exit`) runs in two phases:
1. Drain: new generation requests get 503 `shutting_down` at once; requests in flight keep
   running until they finish or the grace period (`--timeout_graceful_shutdown`) ends.
2. Abort: whatever is still running is aborted; a non-streaming client gets a 503 JSON body,
   a stream gets an error event and `[DONE]`. Only then does uvicorn close the connections and
   the app's lifespan shut the LLM down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

DEFAULT_HEADER_READ_TIMEOUT_S = 30.0
# After the grace period: how long aborted handlers get to write their 503s / error events.
_ABORT_FLUSH_S = 3.0
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 33\r\nconnection: close\r\n\r\nrequest headers were not received"
)


class DrainController:
    """Tracks the server's generation requests and runs the two shutdown phases."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._abort: asyncio.Event | None = None

    @property
    def abort_event(self) -> asyncio.Event:
        # Created on first use, inside the server's event loop.
        if self._abort is None:
            self._abort = asyncio.Event()
        return self._abort

    async def drain(self, grace_s: float) -> None:
        """Phase 1 for up to `grace_s`, then phase 2 for whatever is left."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        if self.in_flight:
            logger.info("draining %d in-flight request(s) for up to %g s", self.in_flight, grace_s)
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.in_flight:
            return
        logger.warning("grace period over: aborting %d request(s)", self.in_flight)
        self.abort_event.set()
        flush_until = time.monotonic() + _ABORT_FLUSH_S
        while self.in_flight and time.monotonic() < flush_until:
            await asyncio.sleep(0.02)


async def until_aborted(stream: AsyncIterator[str], drain: DrainController) -> AsyncIterator[str]:
    """`stream`'s events until it ends or the shutdown's abort phase starts.

    Yields None once when aborted (the caller writes its shutdown events), then stops.
    """
    abort = asyncio.ensure_future(drain.abort_event.wait())
    try:
        while True:
            step = asyncio.ensure_future(anext(stream))  # type: ignore[arg-type]
            done, _ = await asyncio.wait({step, abort}, return_when=asyncio.FIRST_COMPLETED)
            if step in done:
                try:
                    yield step.result()
                except StopAsyncIteration:
                    return
                continue
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
            yield None  # type: ignore[misc]
            return
    finally:
        abort.cancel()


async def monitor_loop_lag(report: Callable[[float], None], period_s: float = 0.05) -> None:
    """Report, once a second, the largest lateness of a `period_s` sleep over that second: how
    long a ready callback waited for the loop (CPU work on the loop shows up here)."""
    loop = asyncio.get_running_loop()
    worst, window_start = 0.0, loop.time()
    while True:
        before = loop.time()
        await asyncio.sleep(period_s)
        now = loop.time()
        worst = max(worst, now - before - period_s)
        if now - window_start >= 1.0:
            report(worst)
            worst, window_start = 0.0, now


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on receiving a request's headers.

    NOTE: uvicorn cancels its keep-alive timer whenever bytes arrive, so a client sending a
    header byte every few seconds would hold the connection forever without this.
    """

    header_read_timeout_s: float = DEFAULT_HEADER_READ_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(
            self.header_read_timeout_s, self._on_header_timeout
        )

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)


class TrtllmServer(uvicorn.Server):
    """uvicorn's server whose shutdown first drains the app's generation requests, and which
    stops (`engine_died` set) when `engine_alive()` turns False: a server whose engine is gone
    must exit non-zero so a supervisor restarts it, not answer 503s forever."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: DrainController,
        engine_alive: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.engine_alive = engine_alive
        self.engine_died = False

    async def on_tick(self, counter: int) -> bool:
        if self.engine_alive is not None and not self.engine_died and not self.engine_alive():
            logger.error("the engine died: stopping the server")
            self.engine_died = True
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        # NOTE: the listeners stay open while draining, so a request arriving now gets a 503
        # JSON answer instead of a refused connection.
        await self.drain.drain(self.config.timeout_graceful_shutdown or 0.0)
        await super().shutdown(sockets)


def make_server(
    app: Any,
    drain: DrainController,
    header_read_timeout_s: float = DEFAULT_HEADER_READ_TIMEOUT_S,
    engine_alive: Callable[[], bool] | None = None,
    **config_kwargs: Any,
) -> TrtllmServer:
    """A `TrtllmServer` for `app` using the guarded h11 protocol."""
    if not header_read_timeout_s > 0:
        raise ValueError(f"header read timeout must be positive, got {header_read_timeout_s}")
    protocol = type(
        "TrtllmH11Protocol", (GuardedH11Protocol,), {"header_read_timeout_s": header_read_timeout_s}
    )
    config = uvicorn.Config(app, http=protocol, **config_kwargs)
    return TrtllmServer(config, drain, engine_alive)
