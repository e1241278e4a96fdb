"""The idle-time arithmetic behind benchmarks/gpu_idle.py, on synthetic traces."""

from __future__ import annotations

import pytest

from tensorrt_llm.bench.gpu_idle import summarize_idle


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
