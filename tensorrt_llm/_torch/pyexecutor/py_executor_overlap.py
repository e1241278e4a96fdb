"""OverlapPyExecutor: the host prepares and launches step n+1 while the GPU still runs step n.

A sampled token stays on the device until the step after it has been launched: the next step reads
it straight from the device tensor (the engine gathers it into its input buffer), and only then
does the host wait for the D2H copy of step n, fill in the tokens, check stop conditions and
respond. Host work (scheduling, step preparation, detokenizing, responses) thus hides behind GPU
time instead of adding to it.

Bookkeeping: when a step is launched, each sampled request gets a PLACEHOLDER token, so lengths,
positions and states are right for the next step before the real token is known. Processing
replaces the placeholder. A request that turns out to have stopped at step n was already launched
in step n+1; that extra token is dropped (its KV write fits the reservation's spare token).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..._utils import async_tensor_d2h
from .llm_request import LlmRequest
from .py_executor import PyExecutor
from .request_errors import run_isolated
from .scheduler import ScheduledRequests

logger = logging.getLogger(__name__)

PLACEHOLDER = -1


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are not on the host yet."""

    requests: list[LlmRequest]  # the sampled requests, in token order
    slots: list[int]  # index of each request's placeholder in output_token_ids
    tokens: torch.Tensor  # [n] device tokens (read by the next step)
    host: torch.Tensor  # [n] host copy, valid once `done` has completed
    done: torch.cuda.Event | None
    rows: dict[int, int]  # request id -> index into `tokens`


def num_real_tokens(req: LlmRequest) -> int:
    """Output tokens whose values are known on the host (placeholders trail the list)."""
    out = req.output_token_ids
    n = len(out)
    while n and out[n - 1] == PLACEHOLDER:
        n -= 1
    return n


class OverlapPyExecutor(PyExecutor):
    """PyExecutor with the overlap scheduler (one step of look-ahead)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: _InFlight | None = None  # the launched step not processed yet

    def _step(self) -> None:
        start = time.perf_counter()
        scheduled = self._schedule()
        if scheduled is None:
            return
        # A request whose last token is already in flight waits for it to be processed.
        scheduled.generation_requests = [
            r
            for r in scheduled.generation_requests
            if r.num_generated_tokens < r.sampling_params.max_tokens
        ]
        launched: _InFlight | None = None
        if scheduled.all_requests:
            ran = scheduled
            try:
                # A request whose own input cannot run fails alone (before anything launched);
                # the step is launched again without it.
                ran, launched = run_isolated(scheduled, self._launch, self._fail_input)
            except Exception as exc:
                logger.exception(
                    "engine step failed; failing every request of the step: %s",
                    [r.request_id for r in ran.all_requests],
                )
                self._process_pending()
                for req in ran.all_requests:
                    if req not in self._active:  # finished by the pending step
                        continue
                    req.set_error(f"engine step failed: {type(exc).__name__}: {exc}")
                    self._finish(req)
                return
        elif self._pending is None:
            self._wait_for_command(0.005)
            return
        self._process_pending()
        self._pending = launched
        self._record_step(scheduled, start)

    def _token_source(
        self, scheduled: ScheduledRequests
    ) -> tuple[torch.Tensor, dict[int, int]] | None:
        pending = self._pending
        if pending is None:
            return None
        rows = {
            r.request_id: pending.rows[r.request_id]
            for r in scheduled.generation_requests
            if r.output_token_ids and r.output_token_ids[-1] == PLACEHOLDER
        }
        return (pending.tokens, rows) if rows else None

    def _launch(self, scheduled: ScheduledRequests) -> _InFlight:
        ctx_not_final = [r for r in scheduled.context_requests if not r.is_last_context_chunk]
        sampled, tokens = self._forward_and_sample(
            scheduled, token_source=self._token_source(scheduled)
        )
        if tokens is None:  # only non-final prefill chunks ran: nothing to sample
            tokens = torch.empty(0, dtype=torch.int64, device=self.model_engine.device)
        # NOTE: the D2H copy is queued now, before the next step's kernels, so waiting on it
        # later waits for this step only.
        host, done = async_tensor_d2h(tokens)
        for req in ctx_not_final:
            req.move_to_next_context_chunk()
        slots = []
        for req in sampled:
            slots.append(len(req.output_token_ids))
            first = req.first_token_time
            req.add_new_token(PLACEHOLDER)
            req.first_token_time = first  # stamped when the real token arrives
        return _InFlight(
            sampled, slots, tokens, host, done, {r.request_id: i for i, r in enumerate(sampled)}
        )

    def _process_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.done is not None:
            pending.done.synchronize()
        values = pending.host.tolist()
        now = time.perf_counter()
        for req, slot, token in zip(pending.requests, pending.slots, values, strict=True):
            if req.is_finished:  # cancelled or failed while in flight
                continue
            later = req.output_token_ids[slot + 1 :]  # placeholders of steps still in flight
            del req.output_token_ids[slot:]
            if req.first_token_time is None:
                req.first_token_time = now
            self.sampler.update_requests([req], [token])
            req.last_token_time = now
            if not req.is_finished:
                req.output_token_ids.extend(later)
        for req in pending.requests:
            if req.request_id in self._callbacks or req in self._active:
                if req.is_finished:
                    self._finish(req)
                else:
                    self._emit(req)

    def _emit(self, req: LlmRequest) -> None:
        # Respond with known tokens only; the trailing placeholders are sent once filled.
        out = req.output_token_ids
        real = num_real_tokens(req)
        if real == len(out):
            super()._emit(req)
            return
        tail = out[real:]
        del out[real:]
        try:
            super()._emit(req)
        finally:
            out.extend(tail)
