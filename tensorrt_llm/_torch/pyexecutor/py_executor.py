"""PyExecutor: the background loop that serves requests with continuous batching.

Each iteration: fetch commands (new requests, cancels, shutdown) -> validate new requests ->
schedule -> build the InputBatch -> run (graph or eager) -> sample -> one D2H of the tokens ->
update the requests (request_lifecycle.py) -> respond -> free the seq slot and KV blocks of
finished requests. The executor is the one owner of the request lifecycle: nothing else appends
tokens, finishes or frees a request.

NOTE: every `LlmRequest` is touched by the loop thread only. Other threads talk to the loop
through the command queue (`enqueue_request`, `cancel_request`, `shutdown`) and read
`get_stats()`, a snapshot published under a lock after each step.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .executor_responses import count_finished, refresh_gauges, response_of
from .executor_types import (  # noqa: F401 (re-exported: the executor's public types)
    SHUTDOWN_ERROR,
    ExecutorStats,
    LlmResponse,
    ResponseCallback,
    deliver_response,
)
from .guided_decoder import GuidedDecoder
from .llm_request import (
    ERROR_ENGINE,
    ERROR_INVALID_INPUT,
    ERROR_SHUTTING_DOWN,
    LlmRequest,
)
from .request_errors import admission_error, run_isolated
from .request_lifecycle import apply_step_results
from .sampler_logprobs import SampledStep
from .step_forward import forward_and_sample

if TYPE_CHECKING:
    from .model_engine import PyTorchModelEngine
    from .resource_manager import KVCacheManager, SeqSlotManager
    from .sampler import TorchSampler
    from .scheduler import ScheduledRequests, SimpleScheduler
    from .spec_decode.spec_decoder import SpecDecoder

logger = logging.getLogger(__name__)


class PyExecutor:
    """Runs the serving loop in a daemon thread, started by `start()`.

    NOTE: construction only wires the parts; subclasses finish their own `__init__` before any
    loop code runs. Requests enqueued before `start()` wait in the command queue.
    """

    def __init__(
        self,
        model_engine: PyTorchModelEngine,
        scheduler: SimpleScheduler,
        sampler: TorchSampler,
        kv_cache_manager: KVCacheManager,
        seq_slot_manager: SeqSlotManager,
        max_seq_len: int = 4096,
        on_step: Callable[[ExecutorStats], None] | None = None,
        stream_interval: int = 1,
    ) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        # A running request's response carries its first token at once, then waits for this
        # many new tokens (EngineConfig.stream_interval); its last response goes out whatever
        # it holds.
        self.stream_interval = stream_interval
        self.model_engine = model_engine
        self.scheduler = scheduler
        self.sampler = sampler
        self.kv_cache_manager = kv_cache_manager
        self.seq_slot_manager = seq_slot_manager
        self.max_seq_len = max_seq_len
        self.on_step = on_step
        # Structured output (guided_decoder.py); set by create_py_executor, None: unsupported.
        self.guided_decoder: GuidedDecoder | None = None
        # MTP speculative decoding (spec_decode/); set by create_py_executor, None: off.
        self.spec_decoder: SpecDecoder | None = None
        # Responses of requests enqueued without a callback land here.
        self.responses: queue.Queue[LlmResponse] = queue.Queue()
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._active: list[LlmRequest] = []  # FCFS order; loop thread only
        self._callbacks: dict[int, ResponseCallback | None] = {}
        self._num_sent: dict[int, int] = {}  # output tokens already emitted, per request
        self._stopping = False
        self._closed = False  # no more enqueues (set by shutdown, any thread)
        self._closed_lock = threading.Lock()
        self._stats = ExecutorStats()
        self._stats_lock = threading.Lock()
        # NOTE: the gauges are right before the first step (metrics read them at startup).
        self._refresh_gauges()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the loop thread. Raises RuntimeError when called twice."""
        if self._thread is not None:
            raise RuntimeError("the executor loop is already started")
        self._thread = threading.Thread(target=self._loop, name="PyExecutor", daemon=True)
        self._thread.start()

    @property
    def loop_thread(self) -> threading.Thread | None:
        """The thread that runs the steps (None before `start`)."""
        return self._thread

    # ---- public API (any thread) ---------------------------------------------------------------
    def enqueue_request(
        self, request: LlmRequest, callback: ResponseCallback | None = None
    ) -> None:
        """Submit a request. Responses go to `callback` (called on the loop thread; keep it
        short) or, without one, to `self.responses`. Raises RuntimeError after shutdown."""
        with self._closed_lock:
            if self._closed:
                raise RuntimeError("the executor is shut down; no new requests are accepted")
            self._commands.put(("request", (request, callback)))

    def cancel_request(self, request_id: int) -> None:
        """Cancel a queued or running request; its final response has finish_reason "cancelled".
        Unknown or already finished ids are ignored."""
        self._commands.put(("cancel", request_id))

    def shutdown(self, wait: bool = True) -> None:
        """Stop the loop. wait=True lets in-flight requests finish first; wait=False fails them
        (error response). Blocks until the loop thread exits either way. Idempotent."""
        with self._closed_lock:
            first = not self._closed
            self._closed = True
            if first:
                self._commands.put(("shutdown", wait))
            if self._thread is None:
                # Never started: the loop still runs once, to answer what was queued.
                self.start()
        thread = self._thread
        assert thread is not None
        if threading.current_thread() is not thread:
            thread.join()
            self._release_device_state()

    def _release_device_state(self) -> None:
        """Drop the model, KV cache and graphs once the loop is gone, so a shut-down executor
        that is still referenced (final stats, old result handles) holds no device memory: the
        KV cache takes most of the GPU by default. `get_stats()` keeps its last snapshot."""
        if self.model_engine is None:  # released by an earlier shutdown
            return
        device = self.model_engine.device
        # Tensor parallelism: the worker ranks exit (getattr: test engines have no channel).
        channel = getattr(self.model_engine, "step_channel", None)
        if channel is not None:
            channel.send_stop()
        self.model_engine = None  # type: ignore[assignment]
        self.kv_cache_manager = None  # type: ignore[assignment]
        self.scheduler = None  # type: ignore[assignment]
        self.sampler = None  # type: ignore[assignment]
        if self.guided_decoder is not None:
            self.guided_decoder.shutdown()
        # The engine and its graph runners reference each other: collect the cycle now, so the
        # memory is back before the next engine of this process measures what is free.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def get_stats(self) -> ExecutorStats:
        with self._stats_lock:
            return ExecutorStats(**vars(self._stats))

    def reset_stats(self) -> None:
        """Zero the counters: the startup warm-up's requests are not the user's. Call it with
        no request in flight."""
        with self._stats_lock:
            self._stats = ExecutorStats()
        self._refresh_gauges()

    # ---- loop ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                self._drain_commands(block=not self._active and not self._stopping)
                if self._stopping and not self._active:
                    break
                if self._active:
                    self._step()
            except Exception as exc:  # a bug outside the step guards: fail all, keep serving
                logger.exception("PyExecutor loop error")
                self._fail_all(f"executor error: {type(exc).__name__}: {exc}")
            self._publish_stats()
        self._publish_stats()

    def _drain_commands(self, block: bool) -> None:
        """Handle every queued command; wait for the first one when idle."""
        while True:
            try:
                kind, payload = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            self._handle_one(kind, payload)

    def _handle_one(self, kind: str, payload: Any) -> None:
        if kind == "request":
            self._accept(*payload)
        elif kind == "cancel":
            self._cancel(payload)
        elif kind == "shutdown":
            self._stopping = True
            if not payload:
                self._fail_all(SHUTDOWN_ERROR, ERROR_SHUTTING_DOWN)

    def _accept(self, request: LlmRequest, callback: ResponseCallback | None) -> None:
        request.accepted_time = time.perf_counter()
        rid = request.request_id
        if any(req.request_id == rid for req in self._active):
            # NOTE: answered apart: the callback, sent count, slot and KV blocks keyed by this
            # id belong to the live request, and `_finish` would free them.
            request.set_error(f"request id {rid} is already in use", ERROR_ENGINE)
            self._deliver(callback, response_of(request, []))
            with self._stats_lock:
                self._stats.num_failed += 1
            return
        self._callbacks[rid] = callback
        self._num_sent[rid] = 0
        rejected = self._validate(request)
        if rejected is not None:
            request.set_error(*rejected)
            self._finish(request)
            return
        self._active.append(request)

    def _validate(self, request: LlmRequest) -> tuple[str, str] | None:
        """(message, error code) when the request cannot be admitted."""
        if self._stopping:
            return SHUTDOWN_ERROR, ERROR_SHUTTING_DOWN
        return admission_error(request, self.sampler, self.guided_decoder, self.why_never_fits)

    def why_never_fits(self, request: LlmRequest) -> str | None:
        """Why the request can never run on this engine (max_seq_len, max_num_tokens, KV
        capacity), or None. Reads fixed sizes only, so any thread may call it (the LLM front
        end does, to raise before submission)."""
        need = request.max_num_tokens
        if need > self.max_seq_len:
            return (
                f"prompt ({request.prompt_len} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) = {need} exceeds max_seq_len="
                f"{self.max_seq_len}"
            )
        return self.scheduler.validate(request)

    def _cancel(self, request_id: int) -> None:
        for req in self._active:
            if req.request_id == request_id:
                req.cancel()
                self._finish(req)
                return

    def _fail_all(self, message: str, code: str = ERROR_ENGINE) -> None:
        for req in list(self._active):
            req.set_error(message, code)
            self._finish(req)

    # ---- one step ------------------------------------------------------------------------------
    def _schedule(self) -> ScheduledRequests | None:
        """This step's batch, or None when the scheduler failed (everything active then fails)."""
        try:
            scheduled = self.scheduler.schedule(self._active)
        except Exception as exc:
            logger.exception("scheduler failed")
            self._fail_all(f"scheduler error: {type(exc).__name__}: {exc}")
            return None
        for req in scheduled.failed:  # can never get its KV blocks: its resources are free
            self._finish(req)
        now = time.perf_counter()
        for req in scheduled.context_requests:  # a step scheduled twice keeps the first stamp
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        if scheduled.preempted:
            logger.debug("preempted %s", [r.request_id for r in scheduled.preempted])
            with self._stats_lock:
                self._stats.num_preemptions += len(scheduled.preempted)
        return scheduled

    def _record_step(self, scheduled: ScheduledRequests, start: float) -> None:
        # Counted here, once per step that ran: the overlap loop may schedule a step twice.
        for req in scheduled.context_requests:
            req.num_context_steps += 1
        with self._stats_lock:
            self._stats.num_steps += 1
            self._stats.last_step_num_tokens = scheduled.num_tokens
            self._stats.last_step_time_s = time.perf_counter() - start

    def _step(self) -> None:
        start = time.perf_counter()
        scheduled = self._schedule()
        if scheduled is None:
            return
        if scheduled.is_empty:
            # Nothing fits right now (resources still held); wait briefly for a command.
            self._wait_for_command(0.005)
            return
        ran = scheduled
        try:
            # A request whose own input cannot run fails alone; the step runs on without it.
            ran, _ = run_isolated(scheduled, self._run_step, self._fail_input)
        except Exception as exc:
            # NOTE: only this step's requests fail; the loop keeps serving the others.
            logger.exception(
                "engine step failed; failing every request of the step: %s",
                [r.request_id for r in ran.all_requests],
            )
            for req in ran.all_requests:
                req.set_error(f"engine step failed: {type(exc).__name__}: {exc}")
        for req in ran.all_requests:
            if req.is_finished:
                self._finish(req)
            else:
                self._emit(req)
        self._record_step(scheduled, start)

    def _fail_input(self, req: LlmRequest, message: str) -> None:
        """Fail one request whose input cannot run (see request_errors.run_isolated)."""
        req.set_error(f"invalid request input: {message}", ERROR_INVALID_INPUT)
        self._finish(req)

    def _forward_and_sample(
        self, scheduled: ScheduledRequests, before_sample: Callable[[], None] | None = None
    ) -> tuple[list[LlmRequest], SampledStep | None]:
        # The body is step_forward.forward_and_sample; a method so the overlap executor calls it.
        parts = (self.model_engine, self.scheduler, self.sampler, self.guided_decoder)
        return forward_and_sample(*parts, scheduled, before_sample)

    def _run_step(self, scheduled: ScheduledRequests) -> None:
        if self.spec_decoder is not None:
            self.spec_decoder.run_step(self, scheduled)
            return
        sampled, step = self._forward_and_sample(scheduled)
        host_tokens: list[int] = []
        logprobs = prompt = None
        if step is not None:
            host_tokens, logprobs, prompt = self.sampler.step_results(step)  # the one sync
        apply_step_results(scheduled, sampled, host_tokens, logprobs, prompt)
        if self.guided_decoder is not None:
            self.guided_decoder.advance(sampled)

    def _wait_for_command(self, timeout: float) -> None:
        try:
            kind, payload = self._commands.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle_one(kind, payload)
        self._drain_commands(block=False)

    # ---- responses and cleanup -----------------------------------------------------------------
    def _emit(self, req: LlmRequest) -> None:
        rid = req.request_id
        sent = self._num_sent.get(rid, 0)
        new = req.output_token_ids[sent:]
        if not req.is_finished and (not new or (sent and len(new) < self.stream_interval)):
            return
        self._num_sent[rid] = sent + len(new)
        self._deliver(self._callbacks.get(rid), response_of(req, new))

    def _deliver(self, callback: ResponseCallback | None, response: LlmResponse) -> None:
        deliver_response(callback, response, self.responses)

    def _finish(self, req: LlmRequest) -> None:
        """Free the request's resources, then send its final response.

        NOTE: in that order, with the stats updated in between, so a caller that reads
        `get_stats()` right after the last result sees no running request and no held slot.
        """
        rid = req.request_id
        try:
            reuse = getattr(self.scheduler, "reuse", None)
            if reuse is not None:
                reuse.register_finished(req)
            self.scheduler.release_resources(req)
        except Exception:
            logger.exception("freeing resources of request %s failed", rid)
        self.sampler.release(rid)
        if self.guided_decoder is not None:
            self.guided_decoder.release(rid)
        if req in self._active:
            self._active.remove(req)
        with self._stats_lock:
            count_finished(self._stats, req)
        self._refresh_gauges()
        self._emit(req)
        self._callbacks.pop(rid, None)
        self._num_sent.pop(rid, None)

    def _refresh_gauges(self) -> ExecutorStats:
        """Update the gauges of the published stats from the live state; returns a copy."""
        with self._stats_lock:
            refresh_gauges(
                self._stats,
                self._active,
                self.kv_cache_manager,
                self.seq_slot_manager,
                self._commands.qsize(),
            )
            return ExecutorStats(**vars(self._stats))

    def _publish_stats(self) -> None:
        snapshot = self._refresh_gauges()
        if self.on_step is not None:
            try:
                self.on_step(snapshot)
            except Exception:
                logger.exception("on_step callback raised")
