"""An opt-in torch-profiler hook for `trtllm-bench`'s timed waves.

A wave's throughput says how long it took, not where the time went. Setting
`TRTLLM_BENCH_PROFILE=/path/to/file` runs each timed wave under `torch.profiler` and appends
its op tables to that file, so a GPU run can show which kernels and host ops dominate without
editing the benchmark; `append_profile_lines` adds the wave's per-request timeline (submit,
arrival, first scheduled chunk, first token, end) after them. Unset (the default), both do
nothing and cost nothing.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PROFILE_ENV = "TRTLLM_BENCH_PROFILE"

logger = logging.getLogger(__name__)


def _table(events: Any, sort_by: str, row_limit: int) -> str:
    kwargs: dict[str, Any] = {"sort_by": sort_by, "row_limit": row_limit}
    if "max_name_column_width" in inspect.signature(events.table).parameters:
        kwargs["max_name_column_width"] = 80
    return str(events.table(**kwargs))


# The device timeline's slices: a wave of a few seconds is a few tens of them.
_TIMELINE_BUCKET_MS = 100


def _idle_lines(prof: Any) -> str:
    """The device's idle share over the wave and per `_TIMELINE_BUCKET_MS` slice."""
    from .gpu_idle import busy_timeline, device_intervals_us, summarize_idle

    intervals = device_intervals_us(prof)
    if not intervals:
        return "device: no activity"
    summary = summarize_idle(intervals, top_gaps=10)
    shares = busy_timeline(intervals, _TIMELINE_BUCKET_MS * 1e3)
    timeline = " ".join(f"{100 * share:.0f}" for share in shares)
    return f"device: {summary.format()}\nbusy % per {_TIMELINE_BUCKET_MS} ms: {timeline}"


def append_profile_lines(label: str, lines: list[str]) -> None:
    """Append `== label ==` and `lines` to the profile file, when `PROFILE_ENV` names one."""
    path = os.environ.get(PROFILE_ENV, "")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n".join([f"== {label} ==", *lines]) + "\n\n")


@contextmanager
def profiled(label: str) -> Iterator[None]:
    """Run the body under the torch profiler when `PROFILE_ENV` names a file, and append a
    `== label ==` header and two op tables (by total device or CPU time, by self CPU time),
    then on CUDA the device's idle share and busy timeline."""
    path = os.environ.get(PROFILE_ENV, "")
    if not path:
        yield
        return

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
    events = prof.key_averages()
    tables = [
        f"== {label} ==",
        _table(events, "cuda_time_total" if cuda else "cpu_time_total", 40),
        _table(events, "self_cpu_time_total", 30),
    ]
    if cuda:
        tables.append(_idle_lines(prof))
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(tables) + "\n\n")
    logger.info("profile of %r appended to %s", label, path)
