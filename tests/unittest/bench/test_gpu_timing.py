"""Graph-replay timing used by the kernel micro-benchmarks (GPU only: it times CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm.bench.gpu_timing import graph_time_us


@pytest.mark.gpu
def test_graph_time_scales_with_the_captured_work() -> None:
    short = graph_time_us(lambda: torch.cuda._sleep(10_000), iters=20)
    long = graph_time_us(lambda: torch.cuda._sleep(1_000_000), iters=20)
    assert 0 < short < long
    assert long > 20 * short  # 100x the cycles; launch cost must not dominate a replay
