"""Per-request timings and their percentile summary."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


@dataclass
class RequestTiming:
    start: float
    first_token: float
    end: float
    num_output_tokens: int
    # Arrival of the last token when the response goes on after it (a served stream still sends
    # usage and [DONE]); None: `end` is the last token.
    last_token: float | None = None

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
    return out


def format_table(rows: list[dict[str, float]], columns: tuple[str, ...]) -> str:
    lines = [" | ".join(columns)]
    for row in rows:
        # A rate (0..1) needs more digits than the milliseconds and tokens around it.
        cells = (f"{row.get(c, float('nan')):.{3 if c.endswith('_rate') else 1}f}" for c in columns)
        lines.append(" | ".join(cells))
    return "\n".join(lines)
