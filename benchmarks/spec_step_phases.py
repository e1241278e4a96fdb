"""Where a speculative step's time goes, window by window: `trtllm-bench` in this process with
the SpecDecoder's phases timed (each phase synchronised on the device, so the sums are walls).

    python benchmarks/spec_step_phases.py [--window N] -- TRTLLM-BENCH-ARGS...

Prints, for each window of N speculative steps, the mean milliseconds of the whole step, of
each phase inside it, and of the executor's time between two steps. Written to find why the
27B rejected-draft step grows with the output length (benchmarks/results/qwen3_6_27b_h200.md).
The synchronisations cost the overlap, so the totals exceed the bench's own ITL.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from tensorrt_llm._torch.pyexecutor import model_engine
from tensorrt_llm._torch.pyexecutor.spec_decode import mtp_drafter, rollback, spec_decoder
from tensorrt_llm.commands import bench

STEP = "step"
GAP = "between steps"


class PhaseClock:
    def __init__(self, window: int) -> None:
        self.window = window
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None
        self.last_end: float | None = None

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if clock.current is None:
                return inner(*args, **kwargs)
            clock._sync()
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            clock._sync()
            clock.current[label] = clock.current.get(label, 0.0) + time.perf_counter() - t
            return out

        setattr(owner, name, timed)

    def wrap_step(self, owner: Any, name: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            clock._sync()
            t = time.perf_counter()
            phases: dict[str, float] = defaultdict(float)
            if clock.last_end is not None:
                phases[GAP] = t - clock.last_end
            clock.current = phases
            try:
                return inner(*args, **kwargs)
            finally:
                clock._sync()
                clock.current = None
                clock.last_end = time.perf_counter()
                phases[STEP] = clock.last_end - t
                clock.steps.append(dict(phases))

        setattr(owner, name, timed)

    def report(self) -> None:
        labels = sorted({k for s in self.steps for k in s}, key=lambda k: (k != STEP, k))
        print(f"{len(self.steps)} speculative steps; mean ms per window of {self.window}")
        print("steps | " + " | ".join(labels))
        for a in range(0, len(self.steps), self.window):
            seg = self.steps[a : a + self.window]
            means = [1000 * sum(s.get(k, 0.0) for s in seg) / len(seg) for k in labels]
            print(f"{a}-{a + len(seg)} | " + " | ".join(f"{m:.2f}" for m in means))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=int, default=32)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    clock = PhaseClock(args.window)
    gc_time = _time_gc(clock)
    sd = spec_decoder.SpecDecoder
    clock.wrap_step(sd, "run_step")
    clock.wrap(spec_decoder, "build_chunk_batch", "build batch")
    clock.wrap(spec_decoder, "build_verify_batch", "build batch")
    clock.wrap(model_engine.PyTorchModelEngine, "run_hidden", "target forward")
    for name in ("_sample", "_to_host", "_apply", "_roll_back"):
        clock.wrap(sd, name, name.strip("_"))
    # The drafts after the forward: the eager passes (plan + run below) or the draft graphs.
    clock.wrap(sd, "_graph_drafts", "draft graphs")
    clock.wrap(rollback.RecurrentRollback, "save", "state save")
    clock.wrap(mtp_drafter.MTPDrafter, "plan", "draft plan")
    clock.wrap(mtp_drafter.MTPDrafter, "run", "draft passes")
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    sys.argv = ["trtllm-bench", *bench_args]
    try:
        bench.main()
    finally:
        clock.report()
        print(f"gc: {gc_time[0]} collections of generation 2, {1000 * gc_time[1]:.0f} ms in all")
        if torch.cuda.is_available():
            _memory_report()


def _time_gc(clock: PhaseClock) -> list[float]:
    """[generation-2 collections, seconds in all collections], kept up to date; a collection
    inside a step is its phase "gc" too."""
    totals = [0, 0.0]
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        spent = time.perf_counter() - started[0]
        totals[1] += spent
        if clock.current is not None:
            clock.current["gc"] = clock.current.get("gc", 0.0) + spent
        totals[0] += info["generation"] == 2

    gc.callbacks.append(callback)
    return totals


def _memory_report() -> None:
    """The caching allocator's counters: retries and device mallocs inside steps cost host time."""
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
    free, total = torch.cuda.mem_get_info()
    print(
        "allocator: "
        + ", ".join(f"{k} {stats.get(k, 0)}" for k in keys)
        + f", reserved {stats.get('reserved_bytes.all.current', 0) / 2**30:.1f} GiB"
        + f", allocated {stats.get('allocated_bytes.all.current', 0) / 2**30:.1f} GiB"
        + f", free {free / 2**30:.1f} of {total / 2**30:.1f} GiB"
    )


if __name__ == "__main__":
    main()
