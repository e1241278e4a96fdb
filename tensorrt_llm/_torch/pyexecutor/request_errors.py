"""Per-request input errors: why a request cannot be admitted, and the errors of an engine
step with the step run again without the requests at fault.

A step batches many requests, so an exception raised while it runs would fail all of them.
`RequestInputError` is for errors that one request's own input causes (a malformed placeholder
span, media without placeholders, too few vision embeddings, ...) and that are found BEFORE the
step mutates any state (KV cache, recurrent state, the mRoPE delta cache). The executor fails
only the named requests and runs the step again without them; anything else still fails the
whole step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

# Defined below the models (which raise it) and re-exported here, where the executor catches it.
from ..input_errors import RequestInputError  # noqa: F401
from .guided_decoder import admit_guided
from .llm_request import ERROR_INVALID_INPUT, ERROR_PROMPT_TOO_LONG, LlmRequest
from .scheduler import ScheduledRequests

if TYPE_CHECKING:
    from .guided_decoder import GuidedDecoder
    from .sampler import TorchSampler

logger = logging.getLogger(__name__)
T = TypeVar("T")


def admission_error(
    request: LlmRequest,
    sampler: TorchSampler,
    guided_decoder: GuidedDecoder | None,
    why_never_fits: Callable[[LlmRequest], str | None],
) -> tuple[str, str] | None:
    """(message, error code) when the request's own input keeps it out, else None."""
    # Token ids the sampler would index with (logit_bias, bad words): out of the vocab
    # they would fault on the device, so the request fails here, alone.
    invalid = sampler.why_invalid(request)
    if invalid is not None:
        return f"invalid sampling parameters: {invalid}", ERROR_INVALID_INPUT
    reason = why_never_fits(request)
    if reason is not None:
        return reason, ERROR_PROMPT_TOO_LONG
    reason = admit_guided(guided_decoder, request)  # None at once when unguided
    return None if reason is None else (reason, ERROR_INVALID_INPUT)


def without_requests(scheduled: ScheduledRequests, drop: Iterable[LlmRequest]) -> ScheduledRequests:
    """`scheduled` minus `drop`, in the same order; the others keep their chunk sizes."""
    gone = {id(req) for req in drop}
    return ScheduledRequests(
        context_requests=[r for r in scheduled.context_requests if id(r) not in gone],
        generation_requests=[r for r in scheduled.generation_requests if id(r) not in gone],
    )


def run_isolated(
    scheduled: ScheduledRequests,
    run: Callable[[ScheduledRequests], T],
    fail: Callable[[LlmRequest, str], None],
) -> tuple[ScheduledRequests, T | None]:
    """`run(scheduled)`; each RequestInputError fails (`fail(request, message)`) the requests
    it names and runs the step again without them. Returns the step that ran and its result
    (None when no request was left). Other exceptions, and a RequestInputError naming no
    request of the step, propagate: the caller fails the whole step."""
    while True:
        try:
            return scheduled, run(scheduled)
        except RequestInputError as exc:
            named = set(exc.request_ids)
            bad = [r for r in scheduled.all_requests if r.request_id in named]
            if not bad:
                raise
            logger.warning(
                "requests %s failed on their input (%s); the step runs on without them",
                [r.request_id for r in bad],
                exc.detail,
            )
            for req in bad:
                fail(req, exc.detail)
            scheduled = without_requests(scheduled, bad)
            if scheduled.is_empty:
                return scheduled, None
