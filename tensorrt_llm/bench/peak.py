"""The peak number of requests the engine runs at once during a wave, sampled from its stats.

With early-stopping requests (`--max_tokens_dist`) the scheduler reserves the large max_tokens
of each; how many requests it then keeps running is the figure that tells whether it admits by
the reservation or by what is used. In process it reads `LLM.get_stats().num_running`; served,
the server's `trtllm_num_requests_running` gauge on /metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

_RUNNING_GAUGE = "trtllm_num_requests_running"
LLM_INTERVAL_S = 0.005  # in process a sample is a copy of the published stats: cheap
SERVED_INTERVAL_S = 0.02  # served it is a /metrics scrape the server renders


class PeakSampler:
    """Polls `read` on a thread while the block runs; `peak` is the largest value seen (None
    when `read` never gave one: the engine exposes no such count)."""

    def __init__(self, read: Callable[[], int | None], interval_s: float) -> None:
        self._read = read
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-peak", daemon=True)
        self.peak: int | None = None

    def _sample(self) -> None:
        try:
            value = self._read()
        except (OSError, RuntimeError, ValueError):
            return  # a scrape that failed mid-run is one sample fewer, not a failed benchmark
        if value is not None and (self.peak is None or value > self.peak):
            self.peak = value

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def llm_running(llm: Any) -> Callable[[], int | None]:
    """The in-process reader: the executor's published count of requests holding a seq slot."""

    def read() -> int | None:
        value = getattr(llm.get_stats(), "num_running", None)
        return None if value is None else int(value)

    return read


def served_running(host: str, port: int) -> Callable[[], int | None]:
    """The served reader: the running-requests gauge from the server's /metrics."""
    from ..serve.metrics import parse_prometheus
    from .sse_client import get_body

    def read() -> int | None:
        body = get_body(host, port, "/metrics", timeout=2.0)
        if body is None:
            return None
        samples = parse_prometheus(body.decode())
        values = [v for k, v in samples.items() if k.split("{", 1)[0] == _RUNNING_GAUGE]
        return int(max(values)) if values else None

    return read
