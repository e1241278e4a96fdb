"""`RequestOutput.metrics`: the engine's timestamps of a request, end to end through `LLM` on a
tiny random checkpoint (CPU), in process and across the process boundary, and what
`trtllm-bench` makes of them (the TTFT phases and the per-request timeline)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.executor_types import LlmResponse, RequestMetrics
from tensorrt_llm.bench.metrics import PHASE_COLUMNS, RequestTiming, summarize, timeline_lines
from tensorrt_llm.bench.workload_modes import table_columns
from tensorrt_llm.executor.protocol import response_from_tuple, response_to_tuple
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

KWARGS: dict[str, Any] = dict(
    device="cpu", max_batch_size=4, max_seq_len=256, tokens_per_block=16, max_num_tokens=8,
    enable_chunked_prefill=True,
)  # fmt: skip
PROMPT = {"prompt_token_ids": list(range(3, 23))}  # 20 tokens: chunks of 8, 8 and 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("request_metrics"))


def _check(metrics: RequestMetrics | None, before: float, after: float, steps: int) -> None:
    assert metrics is not None
    stamps = [
        metrics.arrival_time,
        metrics.accepted_time,
        metrics.first_scheduled_time,
        metrics.first_token_time,
        metrics.finished_time,
    ]
    assert all(s is not None for s in stamps)
    assert before <= stamps[0] and stamps[-1] <= after  # type: ignore[operator]
    assert stamps == sorted(stamps)  # type: ignore[type-var]
    assert metrics.num_context_steps == steps


@pytest.mark.parametrize("mode", ["inproc", "process"])
def test_final_output_carries_the_engine_stamps(ckpt: Path, mode: str) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(str(ckpt), executor_mode=mode, disable_overlap_scheduler=True, **KWARGS) as llm:
        before = time.perf_counter()
        out = llm.generate(PROMPT, params)
        after = time.perf_counter()
        handle = llm.generate_async(PROMPT, params, streaming=True)
        seen = [snap.metrics for snap in handle]
    _check(out.metrics, before, after, steps=3)
    # Streamed: only the final snapshot has them (they are set when the engine finishes it).
    assert seen[-1] is not None and all(m is None for m in seen[:-1])
    # The same prompt again hits the prefix cache: one chunk for the uncached rest.
    assert handle.num_cached_tokens == 16 and seen[-1].num_context_steps == 1


def test_protocol_keeps_the_metrics() -> None:
    m = RequestMetrics(1.0, 1.5, 2.0, 3.0, 4.0, 2)
    back = response_from_tuple(response_to_tuple(LlmResponse(7, [1], True, "length", metrics=m)))
    assert back.metrics == m and back.request_id == 7


def _timing(start: float, m: RequestMetrics | None) -> RequestTiming:
    return RequestTiming(start, start + 0.5, start + 1.0, 4, metrics=m)


def test_bench_phases_and_timeline() -> None:
    # submit 0.1 / 0.2 s, queue 0.05 / 0.15 s, prefill 0.2 / 0.1 s.
    timings = [
        _timing(10.0, RequestMetrics(10.1, 10.12, 10.15, 10.35, 11.0, 2)),
        _timing(10.2, RequestMetrics(10.4, 10.45, 10.55, 10.65, 11.2, 4)),
    ]
    row = summarize(timings, 2.0, 2)
    assert row["submit_ms_p50"] == pytest.approx(150.0)
    assert row["queue_ms_p50"] == pytest.approx(100.0)
    assert row["prefill_ms_p50"] == pytest.approx(150.0)
    assert row["queue_ms_p99"] == pytest.approx(149.0)
    assert row["context_steps_mean"] == 3.0
    assert table_columns([row], ("concurrency",)) == ("concurrency", *PHASE_COLUMNS)
    lines = timeline_lines(list(reversed(timings)), 10.0)
    assert lines[1].split() == ["1", "0.0", "100.0", "120.0", "150.0", "500.0", "1000.0", "2"]
    assert lines[2].split()[:3] == ["0", "200.0", "400.0"]
    # Over HTTP (no engine stamps) the row has no phase columns, and the timeline says so.
    plain = summarize([_timing(1.0, None)], 1.0, 1)
    assert not any(c in plain for c in PHASE_COLUMNS)
    assert timeline_lines([_timing(1.0, None)], 1.0)[1].split()[1:4] == ["0.0", "-", "-"]
