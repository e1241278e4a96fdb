"""OverlapPyExecutor: the host prepares and launches step n+1 while the GPU still runs step n.

A sampled token stays on the device until the step after it has been launched: the next step
reads it from the SlotState token pool (the batch builder gathers it into the input ids on the
device), and only then does the host wait for the D2H copy of step n, apply the tokens, check
stop conditions and respond. Host work (scheduling, step preparation, responses) thus hides
behind GPU time instead of adding to it.

Bookkeeping: when a step is launched, each sampled request counts one token in flight
(`LlmRequest.num_in_flight_tokens`), so lengths and positions are right for the next step before
the value is known; `output_token_ids` only ever holds real tokens. A request that turns out to
have stopped at step n was already launched in step n+1; that extra token is dropped (its KV
write fits the reservation's spare token).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..._utils import async_tensor_d2h
from .llm_request import LlmRequest
from .prompt_logprobs import split_step
from .py_executor import PyExecutor
from .request_errors import run_isolated
from .request_lifecycle import (
    advance_context_chunks,
    apply_new_tokens,
    apply_prompt_logprobs,
    release_prefilled_media,
)
from .sampler_logprobs import SampledStep
from .scheduler import ScheduledRequests

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are not on the host yet."""

    requests: list[LlmRequest]  # the sampled requests, in token order
    host: torch.Tensor  # host copy of the step's tokens (+ logprobs), valid once `done` is
    done: torch.cuda.Event | None
    step: SampledStep  # where the logprobs (output and prompt) sit in `host`


class OverlapPyExecutor(PyExecutor):
    """PyExecutor with the overlap scheduler (one step of look-ahead)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: _InFlight | None = None  # the launched step not processed yet

    def _step(self) -> None:
        start = time.perf_counter()
        guided = self.guided_decoder
        if self._pending is not None and guided is not None:
            if guided.needs_sync(self._pending.requests):
                # A guided mask needs the previous token accepted first: wait for that step
                # (no overlap for this step, for guided batches only), then schedule.
                self._process_pending()
        scheduled = self._schedule()
        if scheduled is None:
            return
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

    def _launch(self, scheduled: ScheduledRequests) -> _InFlight:
        sampled, step = self._forward_and_sample(scheduled)
        if step is None:  # only non-final prefill chunks ran: nothing to sample
            tokens = torch.empty(0, dtype=torch.int64, device=self.model_engine.device)
            step = SampledStep(tokens, tokens, None)
        # NOTE: the D2H copy (tokens and any logprobs in one tensor) is queued now, before the
        # next step's kernels, so waiting on it later waits for this step only.
        host, done = async_tensor_d2h(step.packed)
        release_prefilled_media(scheduled)
        advance_context_chunks(scheduled)
        for req in sampled:
            req.add_in_flight_token()
        return _InFlight(sampled, host, done, step)

    def _process_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.done is not None:
            pending.done.synchronize()
        # Requests cancelled or failed while in flight are skipped.
        tokens, logprobs, prompt = split_step(pending.host, pending.step)
        # Prompt entries first: the response carrying the first token also carries them.
        apply_prompt_logprobs(prompt)
        apply_new_tokens(pending.requests, tokens, in_flight=True, logprobs=logprobs)
        if self.guided_decoder is not None:
            self.guided_decoder.advance(pending.requests)
        for req in pending.requests:
            if req.request_id in self._callbacks or req in self._active:
                if req.is_finished:
                    self._finish(req)
                else:
                    self._emit(req)
