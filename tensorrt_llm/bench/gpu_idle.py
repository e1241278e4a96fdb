"""How much of a time window the GPU sits idle, from the device activities of a profiler trace.

The issue's criterion for steady decode is "GPU idle between steps < 5% of step time". Within a
window that holds many whole steps, idle time is the window minus the union of every device
activity (kernels, copies, memsets); overlapping activities (several streams) count once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class IdleSummary:
    window_us: float
    busy_us: float
    activities: int
    # The longest idle stretches inside the window, longest first (microseconds).
    largest_gaps_us: tuple[float, ...]

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_us / self.window_us if self.window_us > 0 else 0.0

    def format(self) -> str:
        gaps = ", ".join(f"{g:.0f}" for g in self.largest_gaps_us) or "-"
        return (
            f"window {self.window_us / 1e3:.1f} ms, {self.activities} device activities, "
            f"busy {self.busy_us / 1e3:.1f} ms, idle {100 * self.idle_fraction:.2f}% "
            f"(largest gaps, us: {gaps})"
        )


def summarize_idle(
    intervals: Iterable[tuple[float, float]],
    window: tuple[float, float] | None = None,
    top_gaps: int = 5,
) -> IdleSummary:
    """Idle summary of `(start, end)` device intervals (same time unit, e.g. microseconds).

    `window` defaults to the first start .. last end, so the leading and trailing idle time
    before the first and after the last activity (profiler start-up) is left out.
    """
    pairs = [(float(s), float(e)) for s, e in intervals]
    if any(e < s for s, e in pairs):
        raise ValueError("an interval ends before it starts")
    spans = sorted((s, e) for s, e in pairs if e > s)
    if not spans:
        raise ValueError("no device activity in the trace: was the GPU running anything?")
    lo, hi = window if window is not None else (spans[0][0], max(e for _, e in spans))
    if hi <= lo:
        raise ValueError(f"empty window {lo}..{hi}")
    busy, gaps = 0.0, []
    cursor = lo
    for start, end in spans:
        start, end = max(start, lo), min(end, hi)
        if end <= cursor:
            continue
        if start > cursor:
            gaps.append(start - cursor)
            cursor = start
        busy += end - cursor
        cursor = end
    if cursor < hi:
        gaps.append(hi - cursor)
    gaps.sort(reverse=True)
    return IdleSummary(hi - lo, busy, len(spans), tuple(gaps[:top_gaps]))


def device_intervals_us(profiler: object) -> list[tuple[float, float]]:
    """`(start, end)` in microseconds of every CUDA-side activity a torch profiler recorded."""
    from torch.autograd import DeviceType

    events = profiler.profiler.kineto_results.events()  # type: ignore[attr-defined]
    return [
        (e.start_ns() / 1e3, e.end_ns() / 1e3) for e in events if e.device_type() == DeviceType.CUDA
    ]
