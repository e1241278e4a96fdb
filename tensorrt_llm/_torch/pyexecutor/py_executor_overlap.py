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
write lands in the scheduler's look-ahead token). Preempting a request needs its tokens on the
host, so a step whose scheduler wants a victim with a token in flight syncs first.

Guided requests: step n+1's grammar masks need step n's tokens accepted by the matchers. The
forward of step n+1 does not, so it is launched first; then the host waits for step n's tokens,
applies them and advances the matchers (`_accept_pending`) while the GPU runs that forward, and
only then builds the masks and launches the sampling. Responses for step n (finishing requests,
freeing their resources) still wait until step n+1 is launched.

MTP speculation (`spec_decoder` set): step n+1's rows (positions, KV lengths, drafts) depend on
how many drafts step n accepted, which is only known once step n's results are on the host; so
there is no token in flight and no look-ahead launch. What overlaps is the host work that does
not depend on them: the streaming responses of step n are delivered after step n+1's target
forward and sampling are queued, while the device runs them (`SpecDecoder.run_step`'s
`before_sync`). A request that finished at step n is finished (resources freed, final response
sent) at the end of step n, so the scheduler of step n+1 sees the capacity it left.
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
    accepted: bool = False  # its tokens are applied to the requests (responses not sent yet)


class OverlapPyExecutor(PyExecutor):
    """PyExecutor with the overlap scheduler (one step of look-ahead)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: _InFlight | None = None  # the launched step not processed yet
        # MTP: requests of the last step whose streaming response is not sent yet.
        self._unsent: list[LlmRequest] = []

    def _step(self) -> None:
        if self.spec_decoder is not None:
            self._spec_step()
            return
        start = time.perf_counter()
        scheduled = self._schedule()
        if scheduled is not None and scheduled.preemption_deferred and self._pending is not None:
            # A preemption victim's last token is still in flight: it can only be recomputed
            # once that token is on the host, so give up this step's overlap.
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

    def _spec_step(self) -> None:
        """One MTP step; the previous step's streaming responses go out while it runs."""
        start = time.perf_counter()
        scheduled = self._schedule()
        if scheduled is None or scheduled.is_empty:
            self._send_unsent()
            if scheduled is not None:
                self._wait_for_command(0.005)
            return
        decoder = self.spec_decoder
        assert decoder is not None

        def run(s: ScheduledRequests) -> None:
            decoder.run_step(self, s, self._send_unsent)

        ran = scheduled
        try:
            ran, _ = run_isolated(scheduled, run, self._fail_input)
        except Exception as exc:
            logger.exception(
                "engine step failed; failing every request of the step: %s",
                [r.request_id for r in ran.all_requests],
            )
            for req in ran.all_requests:
                req.set_error(f"engine step failed: {type(exc).__name__}: {exc}")
        # The step may have failed before its forward was queued: the earlier responses first.
        self._send_unsent()
        for req in ran.all_requests:
            if req.is_finished:
                self._finish(req)
            else:
                self._unsent.append(req)
        self._record_step(scheduled, start)

    def _send_unsent(self) -> None:
        """Deliver the streaming responses held back from the previous MTP step."""
        unsent, self._unsent = self._unsent, []
        for req in unsent:
            # Finished since (cancelled, failed, or in the step now running): `_finish` sent
            # its tokens with the final response already, or will.
            if req in self._active and not req.is_finished:
                self._emit(req)

    def _launch(self, scheduled: ScheduledRequests) -> _InFlight:
        guided, pending = self.guided_decoder, self._pending
        # A guided mask needs the pending step's tokens: accept them between forward and
        # sampling (see the module docstring).
        sync = guided is not None and pending is not None and guided.needs_sync(pending.requests)
        before_sample = self._accept_pending if sync else None
        sampled, step = self._forward_and_sample(scheduled, before_sample)
        if step is None:  # only non-final prefill chunks ran: nothing to sample
            tokens = torch.empty(0, dtype=torch.int64, device=self.model_engine.device)
            step = SampledStep(tokens, tokens, None)
        # NOTE: the D2H copy (tokens and any logprobs in one tensor) is queued now, before the
        # next step's kernels, so waiting on it later waits for this step only.
        host, done = async_tensor_d2h(step.packed)
        release_prefilled_media(scheduled)
        advance_context_chunks(scheduled)
        for req in sampled:
            if not req.is_finished:  # finished by the tokens accepted before sampling
                req.add_in_flight_token()
        return _InFlight(sampled, host, done, step)

    def _accept_pending(self) -> None:
        """Wait for the pending step's tokens and apply them (matchers advanced); no responses."""
        pending = self._pending
        if pending is None or pending.accepted:
            return
        pending.accepted = True
        if pending.done is not None:
            pending.done.synchronize()
        # Requests cancelled or failed while in flight are skipped.
        tokens, logprobs, prompt = split_step(pending.host, pending.step)
        # Prompt entries first: the response carrying the first token also carries them.
        apply_prompt_logprobs(prompt)
        apply_new_tokens(pending.requests, tokens, in_flight=True, logprobs=logprobs)
        if self.guided_decoder is not None:
            self.guided_decoder.advance(pending.requests)

    def _process_pending(self) -> None:
        self._accept_pending()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        for req in pending.requests:
            if req.request_id in self._callbacks or req in self._active:
                if req.is_finished:
                    self._finish(req)
                else:
                    self._emit(req)
