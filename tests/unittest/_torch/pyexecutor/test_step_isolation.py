"""Issue 13: a request whose own input breaks a step fails alone (defect 1), and the executor's
stats are right at startup and when the last result is delivered (defect 7).

Fake-engine tests use test_py_executor's deterministic engine; the real-engine tests drive the
demo checkpoint's executor with requests whose placeholder spans were corrupted after input
processing (the input processor itself never makes such spans).
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_py_executor import (
    NUM_BLOCKS,
    TIMEOUT,
    Collector,
    FakeEngine,
    assert_all_free,
    expected,
    make_executor,
    park_loop,
    submit,
)

import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import ERROR_INVALID_INPUT, LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import ExecutorStats, LlmResponse
from tensorrt_llm._torch.pyexecutor.request_errors import RequestInputError
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm.inputs.multimodal import (
    MULTIMODAL_LENGTHS,
    MULTIMODAL_POSITIONS,
    MultimodalParams,
)
from tensorrt_llm.serve.metrics import ServerMetrics, parse_prometheus
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

BAD = 50
DEMO_IMAGE = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")
IMAGE_PROMPT = {
    "prompt": "<|vision_start|><|image_pad|><|vision_end|> what is it",
    "multi_modal_data": {"image": [DEMO_IMAGE]},
}


class InputCheckingEngine(FakeEngine):
    """Rejects (before doing anything) every context request whose prompt starts with BAD."""

    def __init__(self) -> None:
        super().__init__()
        self.rejected: list[list[int]] = []

    def forward(self, scheduled: ScheduledRequests) -> object:
        bad = [r.request_id for r in scheduled.context_requests if r.prompt_token_ids[0] == BAD]
        if bad:
            self.rejected.append([r.request_id for r in scheduled.all_requests])
            raise RequestInputError(bad, "placeholder spans do not match the image")
        return super().forward(scheduled)


def test_input_error_fails_only_its_request() -> None:
    ex, _ = make_executor(max_batch_size=4)
    engine = InputCheckingEngine()
    ex.model_engine = engine
    col = Collector()
    park_loop(ex, engine, col)
    submit(ex, col, 1, [BAD, 1], max_tokens=4)
    submit(ex, col, 2, [7, 8], max_tokens=4)
    submit(ex, col, 3, [BAD, 2], max_tokens=4)
    submit(ex, col, 4, [9, 10], max_tokens=4)
    engine.gate.set()
    assert col.wait(0).error is None
    for rid in (1, 3):
        final = col.wait(rid)
        assert final.finish_reason == "error" and final.error_code == ERROR_INVALID_INPUT
        assert "placeholder spans do not match" in (final.error or "")
        assert col.tokens(rid) == []
    for rid, prompt in ((2, [7, 8]), (4, [9, 10])):
        assert col.wait(rid).finish_reason == "length"
        assert col.tokens(rid) == expected(prompt, 4)
    # The rejected step was re-run at once without the bad requests, not a step later.
    assert engine.rejected == [[1, 2, 3, 4]]
    first_run = [ctx for ctx, _ in engine.steps if ctx and ctx[0][0] != 0][0]
    assert [rid for rid, _, _ in first_run] == [2, 4]
    ex.shutdown()
    assert_all_free(ex)
    stats = ex.get_stats()
    assert stats.num_failed == 2 and stats.num_completed == 3


def test_duplicate_request_id_leaves_the_live_request_alone() -> None:
    ex, engine = make_executor(max_batch_size=2)
    col = Collector()
    park_loop(ex, engine, col)
    submit(ex, col, 1, [7, 8], max_tokens=4)
    dup: list[LlmResponse] = []
    got_dup = threading.Event()

    def on_dup(resp: LlmResponse) -> None:
        dup.append(resp)
        got_dup.set()

    ex.enqueue_request(LlmRequest(1, [3], SamplingParams(max_tokens=2)), on_dup)
    engine.gate.set()
    assert got_dup.wait(TIMEOUT)
    assert dup[0].finished and "already in use" in (dup[0].error or "")
    # The live request keeps its callback, its slot and its blocks, and finishes normally.
    assert col.wait(1).finish_reason == "length" and col.tokens(1) == expected([7, 8], 4)
    ex.shutdown()
    assert_all_free(ex)


# ---------------------------------------------------------------------------------- stats


def test_stats_are_right_at_startup() -> None:
    ex, _ = make_executor(max_batch_size=3)
    try:
        stats = ex.get_stats()
        assert stats.num_free_kv_blocks == stats.num_total_kv_blocks == NUM_BLOCKS
        assert stats.num_free_seq_slots == stats.num_total_seq_slots == 3
        samples = parse_prometheus(ServerMetrics("m", stats_fn=ex.get_stats).render())
        assert samples['trtllm_kv_cache_free_blocks{model_name="m"}'] == NUM_BLOCKS
        assert samples['trtllm_seq_slots_free{model_name="m"}'] == 3
        assert samples['trtllm_kv_cache_usage_ratio{model_name="m"}'] == 0
    finally:
        ex.shutdown()


def test_stats_at_final_delivery_show_nothing_running() -> None:
    ex, _ = make_executor(max_batch_size=2)
    seen: list[ExecutorStats] = []
    done = threading.Event()

    def on_response(resp: LlmResponse) -> None:
        if resp.finished:  # the last result is being delivered right now
            seen.append(ex.get_stats())
            done.set()

    ex.enqueue_request(
        LlmRequest(5, [3, 4], SamplingParams(max_tokens=3, temperature=0.0)), on_response
    )
    assert done.wait(TIMEOUT)
    stats = seen[0]
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_seq_slots == 2 and stats.num_free_kv_blocks == NUM_BLOCKS
    assert stats.num_completed == 1
    ex.shutdown()


# ------------------------------------------------------------------------ real engine (demo)


@contextmanager
def _no_thread_switch() -> Iterator[None]:
    """Keep the GIL while requests are enqueued back to back (they then share a step)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


WHY = {
    "no_spans": "image data but no image placeholder spans",
    "short_span": "placeholder tokens but the image data gives",
    "outside_prompt": "spans must lie inside the",
}


def _corrupt(data: dict, how: str) -> dict:
    data = copy.deepcopy(data)
    if how == "no_spans":  # found while preparing the step
        del data[MULTIMODAL_POSITIONS], data[MULTIMODAL_LENGTHS]
    elif how == "short_span":  # found by the merge: fewer placeholders than embeddings
        data[MULTIMODAL_LENGTHS]["image"] = data[MULTIMODAL_LENGTHS]["image"] - 1
    elif how == "outside_prompt":
        data[MULTIMODAL_POSITIONS]["image"] = data[MULTIMODAL_POSITIONS]["image"] + 10_000
    return data


@pytest.fixture(scope="module", params=[False, True], ids=["overlap", "sequential"])
def llm(request: pytest.FixtureRequest) -> Iterator[LLM]:
    with LLM(
        model=str(get_or_build_demo_checkpoint()),
        device="cpu",
        max_batch_size=4,
        disable_overlap_scheduler=request.param,
        executor_mode="inproc",  # the tests record the engine's forward steps
    ) as llm:
        yield llm


@pytest.mark.parametrize("how", ["no_spans", "short_span", "outside_prompt"])
def test_bad_media_request_fails_alone_on_the_real_engine(llm: LLM, how: str) -> None:
    sp = SamplingParams(max_tokens=5, temperature=0.0)
    solo = llm.generate(IMAGE_PROMPT, sp).outputs[0].token_ids
    ids, extra = llm.input_processor(dict(IMAGE_PROMPT), sp)
    executor = llm._executor
    steps: list[list[int]] = []
    build_batch = executor.model_engine.build_batch

    def recording_build(scheduled: ScheduledRequests, *args: object, **kw: object) -> object:
        steps.append([r.request_id for r in scheduled.all_requests])
        return build_batch(scheduled, *args, **kw)

    executor.model_engine.build_batch = recording_build
    col = Collector()
    good = LlmRequest(9001, ids, sp, MultimodalParams(copy.deepcopy(extra["multimodal_data"])))
    bad = LlmRequest(9002, ids, sp, MultimodalParams(_corrupt(extra["multimodal_data"], how)))
    try:
        with _no_thread_switch():
            executor.enqueue_request(bad, col.watch(9002))
            executor.enqueue_request(good, col.watch(9001))
        final_bad, final_good = col.wait(9002), col.wait(9001)
    finally:
        executor.model_engine.build_batch = build_batch
    assert steps[0] == [9002, 9001], "precondition: both requests share the first step"
    assert final_bad.finish_reason == "error" and final_bad.error_code == ERROR_INVALID_INPUT
    assert (final_bad.error or "").startswith("invalid request input: ")
    assert WHY[how] in (final_bad.error or "") and col.tokens(9002) == []
    assert final_good.error is None and col.tokens(9001) == solo
    stats = llm.get_stats()
    assert stats.num_free_seq_slots == stats.num_total_seq_slots
    assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
