"""Per-request input errors of an engine step, and the step without the requests at fault.

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
from typing import TypeVar

# Defined below the models (which raise it) and re-exported here, where the executor catches it.
from ..input_errors import RequestInputError  # noqa: F401
from .llm_request import LlmRequest
from .scheduler import ScheduledRequests

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
