"""PyExecutor against a fake engine with deterministic logits.

The fake engine's next token is `(last input token + 1) % VOCAB`, so every request's expected
output is known up front. Rows of non-final context chunks carry POISON, so sampling one of
them would show up in the output. Real scheduler, KV/slot managers and sampler are used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.llm_request import (
    ERROR_ENGINE,
    ERROR_PROMPT_TOO_LONG,
    ERROR_SHUTTING_DOWN,
    LlmRequest,
)
from tensorrt_llm._torch.pyexecutor.py_executor import (
    SHUTDOWN_ERROR,
    ExecutorStats,
    LlmResponse,
    PyExecutor,
)
from tensorrt_llm._torch.pyexecutor.request_lifecycle import sample_rows
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager
from tensorrt_llm._torch.pyexecutor.sampler import TorchSampler
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests, SimpleScheduler
from tensorrt_llm.sampling_params import SamplingParams

VOCAB = 64
POISON = 63
NUM_BLOCKS = 24
TPB = 4
TIMEOUT = 10.0


class _FakeBatch:
    """What the executor reads of an `InputBatch`: the rows to sample and the seq slots."""

    def __init__(self, scheduled: ScheduledRequests) -> None:
        self.scheduled = scheduled
        self.sample_rows = sample_rows(scheduled)
        slots = [req.seq_slot for req in scheduled.all_requests]
        self.attn_metadata = SimpleNamespace(seq_slots=torch.tensor(slots, dtype=torch.long))
        self.prompt_logprobs = None  # no request asks (prompt_logprobs.py)


class _FakeSlotState:
    def record_tokens(self, seq_slots: torch.Tensor, tokens: torch.Tensor) -> None:
        assert seq_slots.shape == tokens.shape


class FakeEngine:
    """Logits that make the greedy next token `(last token + 1) % VOCAB`."""

    def __init__(self) -> None:
        self.slot_state = _FakeSlotState()
        self.device = torch.device("cpu")
        self.vocab_size = VOCAB
        self.steps: list[tuple[list[tuple[int, int, int]], list[int]]] = []
        self.fail_if: Callable[[ScheduledRequests], bool] = lambda s: False
        self.gate: threading.Event | None = None  # when set, each forward waits on it
        self.entered = threading.Event()  # set once a forward has started
        # A forward for which `hold` is true sets `held` and waits for `resume`.
        self.hold: Callable[[ScheduledRequests], bool] = lambda s: False
        self.held = threading.Event()
        self.resume = threading.Event()
        # Spread logits (a fixed random row per last token) so sampling really draws.
        self.spread = False

    def build_batch(self, scheduled: ScheduledRequests) -> _FakeBatch:
        return _FakeBatch(scheduled)

    def run(self, batch: _FakeBatch) -> torch.Tensor:
        return self.forward(batch.scheduled)

    def forward(self, scheduled: ScheduledRequests) -> torch.Tensor:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(TIMEOUT)
        if self.hold(scheduled):
            self.held.set()
            assert self.resume.wait(TIMEOUT)
        ctx = [
            (r.request_id, r.context_current_position, r.context_chunk_size)
            for r in scheduled.context_requests
        ]
        self.steps.append((ctx, [r.request_id for r in scheduled.generation_requests]))
        if self.fail_if(scheduled):
            raise RuntimeError("injected engine failure")
        last: list[int] = []
        for req in scheduled.context_requests:
            end = req.context_current_position + req.context_chunk_size
            final = end >= req.prompt_len
            last.append(req.prompt_token_ids[end - 1] if final else POISON - 1)
        last += [req.output_token_ids[-1] for req in scheduled.generation_requests]
        if self.spread:
            rows = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(t)) for t in last]
            return torch.stack(rows)
        logits = torch.full((len(last), VOCAB), -10.0)
        logits[torch.arange(len(last)), (torch.tensor(last) + 1) % VOCAB] = 10.0
        return logits


class Collector:
    def __init__(self) -> None:
        self.responses: dict[int, list[LlmResponse]] = {}
        self.done: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def watch(self, rid: int) -> Callable[[LlmResponse], None]:
        self.done[rid] = threading.Event()
        self.responses[rid] = []
        return self._on

    def _on(self, resp: LlmResponse) -> None:
        with self._lock:
            self.responses[resp.request_id].append(resp)
        if resp.finished:
            self.done[resp.request_id].set()

    def wait(self, rid: int) -> LlmResponse:
        assert self.done[rid].wait(TIMEOUT), f"request {rid} did not finish"
        return self.responses[rid][-1]

    def tokens(self, rid: int) -> list[int]:
        return [t for r in self.responses[rid] for t in r.new_token_ids]


def make_executor(
    max_batch_size: int = 4,
    max_num_tokens: int = 64,
    chunked: bool = False,
    max_seq_len: int = 32,
    on_step: Callable[[ExecutorStats], None] | None = None,
    start: bool = True,
    stream_interval: int = 1,
) -> tuple[PyExecutor, FakeEngine]:
    engine = FakeEngine()
    kv = KVCacheManager(1, 1, 2, TPB, NUM_BLOCKS, max_blocks_per_seq=8, dtype=torch.float32)
    slots = SeqSlotManager(max_batch_size)
    scheduler = SimpleScheduler(max_batch_size, max_num_tokens, chunked, kv, slots)
    sampler = TorchSampler(VOCAB, "cpu")
    executor = PyExecutor(
        engine, scheduler, sampler, kv, slots, max_seq_len, on_step=on_step,
        stream_interval=stream_interval,
    )  # fmt: skip
    if start:
        executor.start()
    return executor, engine


def submit(
    ex: PyExecutor, col: Collector, rid: int, prompt: list[int], **params: object
) -> LlmRequest:
    params.setdefault("temperature", 0.0)
    req = LlmRequest(rid, prompt, SamplingParams(**params))  # type: ignore[arg-type]
    ex.enqueue_request(req, col.watch(rid))
    return req


def expected(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + 1 + i) % VOCAB for i in range(n)]


def assert_all_free(ex: PyExecutor) -> None:
    stats = ex.get_stats()
    assert stats.num_free_kv_blocks == NUM_BLOCKS and stats.kv_cache_usage == 0.0
    assert stats.num_free_seq_slots == ex.seq_slot_manager.max_num_slots


def park_loop(ex: PyExecutor, engine: FakeEngine, col: Collector) -> None:
    """Park the loop inside a forward (of a 1-token request, id 0) so that requests enqueued
    next are all seen by the same scheduling round once `engine.gate` is set."""
    engine.gate = threading.Event()
    submit(ex, col, 0, [30], max_tokens=1)
    assert engine.entered.wait(TIMEOUT)


def test_the_loop_starts_in_start_not_in_the_constructor() -> None:
    ex, engine = make_executor(start=False)
    col = Collector()
    submit(ex, col, 1, [4], max_tokens=3)  # queued: nothing runs before start()
    assert not ex.is_alive and not engine.steps
    ex.start()
    assert col.wait(1).finish_reason == "length" and col.tokens(1) == expected([4], 3)
    with pytest.raises(RuntimeError, match="already started"):
        ex.start()
    ex.shutdown()
    assert not ex.is_alive


def test_shutdown_of_a_never_started_executor_answers_what_was_queued() -> None:
    ex, _ = make_executor(start=False)
    col = Collector()
    submit(ex, col, 1, [4], max_tokens=3)
    ex.shutdown(wait=False)
    final = col.wait(1)
    assert final.finished and final.error is not None and not ex.is_alive


def test_continuous_batching_many_requests() -> None:
    ex, engine = make_executor(max_batch_size=4)
    col = Collector()
    park_loop(ex, engine, col)
    prompts = {rid: [rid % 7 + 1] * (2 + rid % 5) + [rid + 3] for rid in range(1, 13)}
    lengths = {rid: 3 + (rid * 5) % 9 for rid in prompts}
    for rid, prompt in prompts.items():
        submit(ex, col, rid, prompt, max_tokens=lengths[rid])
    engine.gate.set()
    for rid, prompt in prompts.items():
        final = col.wait(rid)
        assert final.finish_reason == "length" and final.error is None
        assert col.tokens(rid) == expected(prompt, lengths[rid])
    # Requests joined while others decoded, and the batch never exceeded its cap.
    assert any(ctx and gen for ctx, gen in engine.steps)
    assert max(len(ctx) + len(gen) for ctx, gen in engine.steps) == 4
    ex.shutdown()
    assert_all_free(ex)
    assert ex.get_stats().num_completed == 13


def test_chunked_prefill_samples_only_final_chunk() -> None:
    ex, engine = make_executor(max_num_tokens=4, chunked=True)
    col = Collector()
    prompt = list(range(5, 15))  # 10 tokens -> chunks of 4, 4, 2
    submit(ex, col, 0, prompt, max_tokens=3)
    col.wait(0)
    ex.shutdown()
    assert col.tokens(0) == expected(prompt, 3)
    chunks = [ctx[0][1:] for ctx, _ in engine.steps if ctx]
    assert chunks == [(0, 4), (4, 4), (8, 2)]
    # One response per generated token; nothing was emitted for the non-final chunks.
    assert [len(r.new_token_ids) for r in col.responses[0]] == [1, 1, 1]


def test_stream_interval_sends_the_first_token_then_every_n() -> None:
    # The first token at once (TTFT), then responses of 3 tokens, the last one with the rest
    # (10 = 1 + 3 + 3 + 3; 8 = 1 + 3 + 3 + 1, finished early by its end id); the tokens are
    # those of stream_interval=1.
    ex, _ = make_executor(stream_interval=3)
    col = Collector()
    submit(ex, col, 1, [4], max_tokens=10)
    submit(ex, col, 2, [1], max_tokens=20, end_id=9)  # tokens 2..9
    assert col.wait(1).finish_reason == "length" and col.wait(2).finish_reason == "stop"
    ex.shutdown()
    assert [len(r.new_token_ids) for r in col.responses[1]] == [1, 3, 3, 3]
    assert col.tokens(1) == expected([4], 10)
    assert [len(r.new_token_ids) for r in col.responses[2]] == [1, 3, 3, 1]
    assert col.tokens(2) == list(range(2, 10))
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        make_executor(stream_interval=0, start=False)


def test_chunking_does_not_perturb_seeded_sampling() -> None:
    prompt = list(range(5, 15))
    outputs = []
    for chunked, max_num_tokens in ((False, 64), (True, 4)):
        ex, engine = make_executor(max_num_tokens=max_num_tokens, chunked=chunked)
        engine.spread = True
        col = Collector()
        submit(ex, col, 0, prompt, max_tokens=8, temperature=1.0, seed=123)
        col.wait(0)
        ex.shutdown()
        outputs.append(col.tokens(0))
    assert outputs[0] == outputs[1]
    assert len(set(outputs[0])) > 1


def test_cancel_frees_slot_and_blocks() -> None:
    ex, engine = make_executor()
    col = Collector()
    engine.hold = lambda s: any(
        r.request_id == 1 and len(r.output_token_ids) >= 3 for r in s.generation_requests
    )
    submit(ex, col, 1, [1, 2, 3], max_tokens=20)
    submit(ex, col, 2, [4, 5], max_tokens=2)
    assert engine.held.wait(TIMEOUT)  # request 1 is mid-generation
    ex.cancel_request(1)
    engine.resume.set()
    final = col.wait(1)
    assert final.finish_reason == "cancelled" and final.finished
    assert col.tokens(1) == expected([1, 2, 3], 4)  # the in-flight step still lands
    assert col.wait(2).finish_reason == "length"
    ex.cancel_request(12345)  # unknown ids are ignored
    submit(ex, col, 3, [9], max_tokens=2)
    assert col.wait(3).finish_reason == "length" and col.tokens(3) == expected([9], 2)
    ex.shutdown()
    assert_all_free(ex)
    assert ex.get_stats().num_cancelled == 1


def test_engine_exception_fails_only_that_step() -> None:
    ex, engine = make_executor(max_batch_size=2)
    col = Collector()
    park_loop(ex, engine, col)
    engine.fail_if = lambda s: any(r.prompt_token_ids[0] == 50 for r in s.context_requests)
    submit(ex, col, 1, [50, 1], max_tokens=4)  # poisons its step
    submit(ex, col, 2, [7, 8], max_tokens=4)  # same step: fails too
    submit(ex, col, 3, [9, 10], max_tokens=4)  # no room in that step: must succeed
    engine.gate.set()
    assert col.wait(0).error is None
    for rid in (1, 2):
        final = col.wait(rid)
        assert final.finish_reason == "error" and final.error_code == ERROR_ENGINE
        assert "injected engine failure" in (final.error or "")
    assert col.wait(3).finish_reason == "length"
    assert col.tokens(3) == expected([9, 10], 4)
    submit(ex, col, 4, [20], max_tokens=2)  # the loop keeps serving
    assert col.wait(4).error is None and col.tokens(4) == expected([20], 2)
    ex.shutdown()
    assert_all_free(ex)
    assert ex.get_stats().num_failed == 2


def test_validation_fails_only_the_bad_request() -> None:
    ex, _ = make_executor(max_seq_len=16)
    col = Collector()
    submit(ex, col, 1, list(range(1, 11)), max_tokens=10)  # 20 > max_seq_len
    final = col.wait(1)
    assert final.finish_reason == "error" and "max_seq_len=16" in (final.error or "")
    assert final.error_code == ERROR_PROMPT_TOO_LONG
    assert col.tokens(1) == []
    submit(ex, col, 2, [3, 4], max_tokens=3)
    assert col.wait(2).error is None and col.tokens(2) == expected([3, 4], 3)
    ex.shutdown()


def test_stop_conditions_flow_through() -> None:
    ex, _ = make_executor()
    col = Collector()
    submit(ex, col, 1, [1], max_tokens=10, end_id=5)  # tokens 2,3,4,5 -> stops at end id
    submit(ex, col, 2, [1], max_tokens=10, stop_token_ids=[4])
    submit(ex, col, 3, [1], max_tokens=5, stop="fg")  # stop strings are the front end's
    submit(ex, col, 4, [1], max_tokens=10, end_id=5, ignore_eos=True)
    final = col.wait(1)
    assert (final.finish_reason, final.stop_reason) == ("stop", 5)
    assert col.tokens(1) == [2, 3, 4, 5]
    final = col.wait(2)
    assert (final.finish_reason, final.stop_reason) == ("stop", 4)
    final = col.wait(3)
    assert (final.finish_reason, final.stop_reason) == ("length", None)
    assert col.tokens(3) == [2, 3, 4, 5, 6]
    assert col.wait(4).finish_reason == "length" and len(col.tokens(4)) == 10
    ex.shutdown()


def test_shutdown_wait_finishes_in_flight() -> None:
    ex, engine = make_executor()
    col = Collector()
    engine.gate = threading.Event()
    submit(ex, col, 1, [1, 2], max_tokens=5)
    submit(ex, col, 2, [3], max_tokens=7)
    engine.gate.set()
    ex.shutdown(wait=True)
    assert not ex.is_alive
    for rid, prompt, n in ((1, [1, 2], 5), (2, [3], 7)):
        assert col.done[rid].is_set() and col.tokens(rid) == expected(prompt, n)
    with pytest.raises(RuntimeError, match="shut down"):
        ex.enqueue_request(LlmRequest(9, [1], SamplingParams()))
    ex.shutdown()  # idempotent


def test_shutdown_nowait_fails_in_flight() -> None:
    ex, engine = make_executor()
    col = Collector()
    engine.gate = threading.Event()
    submit(ex, col, 1, [1, 2], max_tokens=30)
    assert engine.entered.wait(TIMEOUT)  # the loop is now parked inside forward
    threading.Timer(0.05, engine.gate.set).start()
    ex.shutdown(wait=False)
    final = col.wait(1)
    assert final.finish_reason == "error" and final.error == SHUTDOWN_ERROR
    assert final.error_code == ERROR_SHUTTING_DOWN
    assert len(col.tokens(1)) < 30
    assert_all_free(ex)


def test_response_queue_and_stats_callback() -> None:
    seen: list[ExecutorStats] = []
    ex, _ = make_executor(on_step=seen.append)
    req = LlmRequest(7, [4, 5], SamplingParams(max_tokens=3, temperature=0.0))
    ex.enqueue_request(req)
    tokens: list[int] = []
    while True:
        resp = ex.responses.get(timeout=TIMEOUT)
        assert resp.request_id == 7
        tokens += resp.new_token_ids
        if resp.finished:
            break
    ex.shutdown()
    assert tokens == expected([4, 5], 3)
    assert seen and max(s.num_steps for s in seen) >= 3
    assert any(s.num_running == 1 and s.kv_cache_usage > 0 for s in seen)
