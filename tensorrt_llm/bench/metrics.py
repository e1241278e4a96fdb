"""Per-request timings and their percentile summary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .._torch.pyexecutor.executor_types import RequestMetrics

# The columns of trtllm-bench's in-process result table.
RESULT_COLUMNS = (
    "concurrency",
    "output_tok_s",
    "per_user_tok_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "latency_ms_p50",
    "latency_ms_p99",
)
# Where the TTFT goes, from the engine's `RequestMetrics` (in-process and process-mode runs):
# submit = the call to the engine request's arrival (input processing, checks, the IPC),
# queue = arrival to its first scheduled chunk, prefill = that to the first token.
PHASES = ("submit", "queue", "prefill")
PHASE_COLUMNS = (*(f"{p}_ms_p50" for p in PHASES), "context_steps_mean")


@dataclass
class RequestTiming:
    start: float
    first_token: float
    end: float
    num_output_tokens: int
    # Arrival of the last token when the response goes on after it (a served stream still sends
    # usage and [DONE]); None: `end` is the last token.
    last_token: float | None = None
    # The engine's stamps (RequestOutput.metrics, same clock as `start`); None over HTTP.
    metrics: RequestMetrics | None = None

    @property
    def phases(self) -> tuple[float, float, float] | None:
        """Seconds in each of `PHASES`, when the engine's stamps cover them."""
        m = self.metrics
        if m is None or m.first_scheduled_time is None or m.first_token_time is None:
            return None
        return (
            m.arrival_time - self.start,
            m.first_scheduled_time - m.arrival_time,
            m.first_token_time - m.first_scheduled_time,
        )

    @property
    def ttft(self) -> float:
        return self.first_token - self.start

    @property
    def itl(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        last = self.end if self.last_token is None else self.last_token
        return (last - self.first_token) / (self.num_output_tokens - 1)

    @property
    def latency(self) -> float:
        return self.end - self.start


def summarize(timings: list[RequestTiming], wall: float, concurrency: int) -> dict[str, float]:
    """Output tok/s, per-user tok/s and p50/p90/p99 of TTFT, ITL and latency (milliseconds)."""
    tokens = sum(t.num_output_tokens for t in timings)
    out: dict[str, float] = {
        "concurrency": concurrency,
        "requests": len(timings),
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "wall_s": wall,
    }
    itls = [t.itl for t in timings if t.itl is not None]
    out["per_user_tok_s"] = 1.0 / float(np.mean(itls)) if itls else 0.0
    for name, values in (
        ("ttft_ms", [t.ttft for t in timings]),
        ("itl_ms", itls),
        ("latency_ms", [t.latency for t in timings]),
    ):
        arr = np.asarray(values or [0.0]) * 1e3
        for p in (50, 90, 99):
            out[f"{name}_p{p}"] = float(np.percentile(arr, p))
    phases = [t.phases for t in timings]
    if timings and all(p is not None for p in phases):
        ms = np.asarray(phases) * 1e3
        for i, name in enumerate(PHASES):
            for p in (50, 99):
                out[f"{name}_ms_p{p}"] = float(np.percentile(ms[:, i], p))
        steps = [t.metrics.num_context_steps for t in timings if t.metrics is not None]
        out["context_steps_mean"] = float(np.mean(steps))
    return out


def timeline_lines(timings: list[RequestTiming], origin: float) -> list[str]:
    """One line per request (by start): its stamps in ms from `origin` (the wave's start)."""
    head = "request  start  arrival  accepted  scheduled  first_token  end  context_steps"
    lines = [head]
    for i, t in sorted(enumerate(timings), key=lambda it: it[1].start):
        m = t.metrics
        stamps = [t.start, None, None, None, t.first_token, t.end]
        if m is not None:
            stamps[1:4] = [m.arrival_time, m.accepted_time, m.first_scheduled_time]
        cells = ["-" if s is None else f"{(s - origin) * 1e3:.1f}" for s in stamps]
        steps = "-" if m is None else str(m.num_context_steps)
        lines.append("  ".join([str(i), *cells, steps]))
    return lines


def format_table(rows: list[dict[str, float]], columns: tuple[str, ...]) -> str:
    lines = [" | ".join(columns)]
    for row in rows:
        # A rate (0..1) needs more digits than the milliseconds and tokens around it.
        cells = (f"{row.get(c, float('nan')):.{3 if c.endswith('_rate') else 1}f}" for c in columns)
        lines.append(" | ".join(cells))
    return "\n".join(lines)
