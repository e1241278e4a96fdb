"""GenerationResult: the handle `LLM.generate_async` returns.

It is a `RequestOutput` that fills in as executor responses arrive. Use `.result()` to block,
`await handle` in asyncio code, and `async for out in handle` (or plain `for`) to stream
snapshots with `text_diff`/`token_ids_diff` of each update.

Threading: the executor thread (or, with the engine in its own process, the proxy's receiver
thread) only appends responses to a locked list and wakes waiters; detokenization and the
stop-string checks run in the consumer's thread, so a slow tokenizer never stalls the engine
loop. A stop string found there cancels the engine's request.
Without streaming the text is decoded once at the end (unless stop strings need it sooner);
iterating such a handle shows token ids as they come and the text when it finishes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

from .logprobs import to_prompt_logprobs
from .loop_waker import LoopWaker, waker_for
from .outputs import CompletionOutput, CompletionState, RequestOutput

if TYPE_CHECKING:
    from .._torch.pyexecutor.py_executor import LlmResponse
    from ..sampling_params import SamplingParams


class GenerationResult(RequestOutput):
    """A `RequestOutput` being filled by the executor (one executor request per completion)."""

    # A handle is an entity: identity equality and hashing (asyncio.gather needs hashable
    # awaitables). Snapshots, plain RequestOutputs, keep value equality.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __init__(
        self,
        request_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        tokenizer: Any | None,
        child_request_ids: list[int],
        abort_fn: Callable[[int], None] | None = None,
        streaming: bool = False,
    ) -> None:
        outputs = [CompletionOutput(index=i) for i in range(len(child_request_ids))]
        super().__init__(request_id, prompt, prompt_token_ids, outputs)
        self.streaming = streaming
        self.sampling_params = sampling_params
        self._index_of = {rid: i for i, rid in enumerate(child_request_ids)}
        self._abort_fn = abort_fn
        self._states = [
            CompletionState(
                out,
                tokenizer,
                sampling_params.stop_strings,
                include_stop_str=sampling_params.include_stop_str_in_output,
                detokenize=sampling_params.detokenize,
                final_text_only=not streaming,
                min_tokens=sampling_params.min_tokens,
                skip_special_tokens=sampling_params.skip_special_tokens,
                spaces_between_special_tokens=sampling_params.spaces_between_special_tokens,
            )
            for out in outputs
        ]
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: list[LlmResponse] = []
        self._process_lock = threading.Lock()
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._aio_event: asyncio.Event | None = None
        self._aio_waker: LoopWaker | None = None
        self._wake_scheduled = False  # a call_soon_threadsafe(event.set) is queued
        # Set on every response: `LLM.generate` waits on one event for a whole batch.
        self.listener: threading.Event | None = None

    # ---- producer side (executor thread) -------------------------------------------------------
    def _on_response(self, response: LlmResponse) -> None:
        with self._cond:
            self._pending.append(response)
            self._cond.notify_all()
            waker, event = self._aio_waker, self._aio_event
            # One wake-up per wait; the waker also batches wake-ups across requests.
            wake: tuple[LoopWaker, asyncio.Event] | None = None
            if waker is not None and event is not None and not self._wake_scheduled:
                self._wake_scheduled = True
                wake = (waker, event)
            listener = self.listener
        if listener is not None:
            listener.set()
        if wake is not None:
            waker, event = wake
            waker.set_soon(event)

    # ---- consumer side -------------------------------------------------------------------------
    def _process(self) -> bool:
        """Apply pending responses. Returns True when anything visible changed."""
        with self._process_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch or self.finished:
                return False
            for state in self._states:
                state.begin_update()
            for response in batch:
                self._apply(response)
            self.finished = all(out.finished for out in self.outputs)
            return True

    def _apply(self, response: LlmResponse) -> None:
        index = self._index_of.get(response.request_id)
        if index is None:
            return
        state = self._states[index]
        if state.output.finished:
            return  # e.g. a stop string was found here and the abort is still in flight
        if response.error is not None:
            self.error = response.error
            self.error_code = response.error_code
        if response.prompt_logprobs is not None and self.prompt_logprobs is None:
            # Only the first completion's engine request computes them (LLM._child_params).
            prompt = to_prompt_logprobs(self.prompt_token_ids, response.prompt_logprobs)
            self.prompt_logprobs = prompt
            for out in self.outputs:
                out.prompt_logprobs = prompt
        if index == 0:
            # The prompt is shared by the n completions; the first one's hit is the prompt's
            # (later ones may hit the blocks the first one just wrote).
            self.num_cached_tokens = response.num_cached_tokens
            if response.metrics is not None:
                self.metrics = response.metrics
        ids = response.new_token_ids
        text_ids = ids
        stop_token = response.finish_reason == "stop" and isinstance(response.stop_reason, int)
        if stop_token and ids and not self.sampling_params.include_stop_str_in_output:
            text_ids = ids[:-1]  # the stop token counts as generated but is not text
        if state.add_tokens(ids, text_ids, response.new_logprobs):
            # A stop string ended the completion on this side; free the executor's copy.
            if not response.finished and self._abort_fn is not None:
                self._abort_fn(response.request_id)
            return
        if response.finished:
            state.finish(response.finish_reason or "stop", response.stop_reason)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until every completion finished; return self. TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._process()
            if self.finished:
                return self
            with self._cond:
                if self._pending:
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
                self._cond.wait(remaining)

    async def _wait_async(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._pending:
                return
            if self._aio_loop is not loop or self._aio_event is None:
                self._aio_loop, self._aio_event = loop, asyncio.Event()
                self._aio_waker = waker_for(loop)
            event = self._aio_event
            # NOTE: cleared under the lock after checking `_pending`, and set only through the
            # loop's waker (call_soon_threadsafe), so a response can never be missed: the next
            # response after this point always schedules a wake-up.
            event.clear()
            self._wake_scheduled = False
        await event.wait()

    async def aresult(self) -> GenerationResult:
        while True:
            self._process()
            if self.finished:
                return self
            await self._wait_async()

    def __await__(self) -> Generator[Any, None, GenerationResult]:
        return self.aresult().__await__()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            if self._process():
                yield self.snapshot()
            elif not self.finished:
                await self._wait_async()

    def __iter__(self) -> Iterator[RequestOutput]:
        """Synchronous streaming: yields a snapshot per update until finished."""
        while not self.finished:
            if self._process():
                yield self.snapshot()
                continue
            with self._cond:
                if not self._pending:
                    self._cond.wait()

    def abort(self) -> None:
        """Cancel every completion of this request (their finish_reason becomes "cancelled")."""
        if self._abort_fn is None:
            return
        for rid, index in self._index_of.items():
            if not self.outputs[index].finished:
                self._abort_fn(rid)
