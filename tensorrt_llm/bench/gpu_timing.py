"""GPU time of CUDA-graph replays, for the kernel micro-benchmarks under `benchmarks/`.

Decode steps are served as graph replays, so a kernel's cost there excludes Python launch
overhead; timing eager calls instead measures the host (an eager sweep once ranked the
decode split counts backwards for exactly that reason).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def replay_time_us(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Mean GPU microseconds of one replay of `graph`, from CUDA events around `iters` replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def graph_time_us(fn: Callable[[], object], iters: int = 50) -> float:
    """Capture `fn` (after one eager call that compiles and allocates) and time its replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()  # first replay pays one-time costs
    return replay_time_us(graph, iters)
