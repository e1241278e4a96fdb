"""The idle-time arithmetic behind benchmarks/gpu_idle.py, on synthetic traces."""

from __future__ import annotations

import pytest

from tensorrt_llm.bench.gpu_idle import split_idle_at_launches, summarize_idle


def test_overlaps_count_once_and_gaps_are_found() -> None:
    # Two streams overlap on 10..30; gaps 30..40 and 60..65 inside 0..65.
    s = summarize_idle([(0, 20), (10, 30), (40, 60), (65, 65)], window=(0, 65))
    assert s.busy_us == 50
    assert s.largest_gaps_us == (10, 5)
    assert s.idle_fraction == pytest.approx(15 / 65)
    assert s.activities == 3  # the zero-length activity is dropped


def test_default_window_and_clipping() -> None:
    s = summarize_idle([(5, 10), (12, 20)])
    assert (s.window_us, s.busy_us, s.largest_gaps_us) == (15, 13, (2,))
    # A window cutting into activities counts only the part inside it.
    clipped = summarize_idle([(0, 10), (20, 30)], window=(5, 25))
    assert clipped.busy_us == 10 and clipped.largest_gaps_us == (10,)
    assert "idle 50.00%" in clipped.format()


def test_bad_traces_raise() -> None:
    with pytest.raises(ValueError, match="no device activity"):
        summarize_idle([])
    with pytest.raises(ValueError, match="ends before it starts"):
        summarize_idle([(5, 1)])
    with pytest.raises(ValueError, match="empty window"):
        summarize_idle([(0, 1)], window=(3, 3))


def test_idle_inside_graph_replays_is_split_from_idle_between_them() -> None:
    # Launch 7 (a replay): kernels 0..10, 12..20 and a copy on another stream 19..25: 2 us idle
    # inside its span 0..25. Launch 8: 40..50, 51..60: 1 us inside. A lone kernel (launch 9) at
    # 30..35 is not a replay. Idle in all: 2 + 5 (25..30) + 5 (35..40) + 1 = 13 of 60.
    intervals = [(0, 10), (12, 20), (19, 25), (30, 35), (40, 50), (51, 60)]
    s = split_idle_at_launches(summarize_idle(intervals), intervals, [7, 7, 7, 9, 8, 8])
    assert s.launches == 2
    assert s.idle_inside_launches_us == pytest.approx(3)
    assert s.idle_fraction == pytest.approx(13 / 60)
    assert s.idle_between_launches_fraction == pytest.approx(10 / 60)
    assert "between graph replays 16.67%, inside the 2 replays 5.00%" in s.format()
    # Unsplit summaries say nothing of the split.
    assert summarize_idle(intervals).idle_between_launches_fraction is None
    with pytest.raises(ValueError, match="launch ids"):
        split_idle_at_launches(s, intervals, [1])


@pytest.mark.gpu
def test_gpu_trace_groups_each_graph_replay_by_its_launch() -> None:
    """On a real trace, the kernels of one CUDA graph replay share a launch id: three replays
    of a three-kernel graph are three launches."""
    import torch

    from tensorrt_llm.bench.gpu_idle import device_activities

    x = torch.zeros(1 << 20, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up outside the graph
        graph.capture_begin()
        x.add_(1)
        x.mul_(2)
        x.sub_(1)
        graph.capture_end()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    intervals, launch_ids = device_activities(prof)
    s = split_idle_at_launches(summarize_idle(intervals), intervals, launch_ids)
    assert s.launches == 3
    assert len(intervals) == 9


def test_busy_timeline_places_the_idle_stretch() -> None:
    """Busy 0-100 and 250-400 us in 100 us slices: the second slice is the idle one."""
    from tensorrt_llm.bench.gpu_idle import busy_timeline

    shares = busy_timeline([(0, 100), (250, 300), (280, 400)], 100)
    assert [round(s, 2) for s in shares] == [1.0, 0.0, 0.5, 1.0]
    assert busy_timeline([], 100) == []
    with pytest.raises(ValueError, match="positive"):
        busy_timeline([(0, 1)], 0)
