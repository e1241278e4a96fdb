"""How much of a time window the GPU sits idle, from the device activities of a profiler trace.

The issue's criterion for steady decode is "GPU idle between steps < 5% of step time". Within a
window that holds many whole steps, idle time is the window minus the union of every device
activity (kernels, copies, memsets); overlapping activities (several streams) count once.

That idle time has two parts with different causes, so `split_idle_at_launches` separates them:
the gaps inside a CUDA graph replay (kernel-to-kernel latency, ~0.5 us per kernel boundary,
set by how many kernels a step has) and the rest, between replays (host preparation, sampling,
copies: what "idle between steps" means). Every kernel of one replay carries the correlation id
of its `cudaGraphLaunch`, which is how replays are told apart in a trace.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class IdleSummary:
    window_us: float
    busy_us: float
    activities: int
    # The longest idle stretches inside the window, longest first (microseconds).
    largest_gaps_us: tuple[float, ...]
    # Set by `split_idle_at_launches`: the idle time inside graph replays' spans, and how
    # many replays (launches of more than one activity) the window holds.
    idle_inside_launches_us: float | None = None
    launches: int = 0

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_us / self.window_us if self.window_us > 0 else 0.0

    @property
    def idle_between_launches_fraction(self) -> float | None:
        if self.idle_inside_launches_us is None or self.window_us <= 0:
            return None
        idle = self.window_us - self.busy_us - self.idle_inside_launches_us
        return idle / self.window_us

    def format(self) -> str:
        gaps = ", ".join(f"{g:.0f}" for g in self.largest_gaps_us) or "-"
        text = (
            f"window {self.window_us / 1e3:.1f} ms, {self.activities} device activities, "
            f"busy {self.busy_us / 1e3:.1f} ms, idle {100 * self.idle_fraction:.2f}% "
            f"(largest gaps, us: {gaps})"
        )
        between = self.idle_between_launches_fraction
        if between is not None:
            assert self.idle_inside_launches_us is not None
            inside = self.idle_inside_launches_us / self.window_us
            text += (
                f"; between graph replays {100 * between:.2f}%, inside the "
                f"{self.launches} replays {100 * inside:.2f}%"
            )
        return text


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


def split_idle_at_launches(
    summary: IdleSummary,
    intervals: Sequence[tuple[float, float]],
    launch_ids: Sequence[int],
) -> IdleSummary:
    """`summary` (of `intervals`, default window) with the idle time inside each launch's span
    (first start .. last end of the activities sharing a launch id, for launches of more than
    one activity: graph replays) counted apart from the idle time between them."""
    if len(intervals) != len(launch_ids):
        raise ValueError(f"{len(intervals)} intervals but {len(launch_ids)} launch ids")
    members: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for interval, launch in zip(intervals, launch_ids, strict=True):
        members[launch].append(interval)
    spans = sorted(
        (min(s for s, _ in group), max(e for _, e in group))
        for group in members.values()
        if len(group) > 1
    )
    inside = 0.0
    for lo, hi in spans:
        if hi <= lo:
            continue
        # Every activity overlapping the span counts as busy, whichever launch it belongs to.
        overlapping = [(s, e) for s, e in intervals if s < hi and e > lo]
        inside += (hi - lo) - summarize_idle(overlapping, window=(lo, hi)).busy_us
    return replace(summary, idle_inside_launches_us=inside, launches=len(spans))


def busy_timeline(intervals: Sequence[tuple[float, float]], bucket_us: float) -> list[float]:
    """The busy share of each `bucket_us` slice of the window (first start .. last end): where
    in a wave the device idles (a slow start, gaps between steps), which one total hides."""
    if bucket_us <= 0:
        raise ValueError(f"bucket_us must be positive, got {bucket_us}")
    spans = sorted((s, e) for s, e in intervals if e > s)
    if not spans:
        return []
    lo, hi = spans[0][0], max(e for _, e in spans)
    shares = []
    start = lo
    while start < hi:
        end = min(start + bucket_us, hi)
        inside = [(s, e) for s, e in spans if s < end and e > start]
        busy = summarize_idle(inside, window=(start, end)).busy_us if inside else 0.0
        shares.append(busy / (end - start))
        start = end
    return shares


def device_activities(profiler: object) -> tuple[list[tuple[float, float]], list[int]]:
    """`(start, end)` in microseconds of every CUDA-side activity a torch profiler recorded,
    and each one's launch correlation id (shared by all kernels of one graph replay)."""
    from torch.autograd import DeviceType

    events = profiler.profiler.kineto_results.events()  # type: ignore[attr-defined]
    cuda = [e for e in events if e.device_type() == DeviceType.CUDA]
    return [(e.start_ns() / 1e3, e.end_ns() / 1e3) for e in cuda], [
        e.correlation_id() for e in cuda
    ]


def device_intervals_us(profiler: object) -> list[tuple[float, float]]:
    """`(start, end)` in microseconds of every CUDA-side activity a torch profiler recorded."""
    return device_activities(profiler)[0]
