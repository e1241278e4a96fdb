"""`RequestInputError`: one request's own input cannot run in this engine step.

It lives here, below both the models that raise it and the executor that catches it
(`pyexecutor/request_errors.py` re-exports it and says what the executor does with it).
"""

from __future__ import annotations

from collections.abc import Iterable


class RequestInputError(ValueError):
    """The input of `request_ids` cannot run; nothing of the step has been mutated yet.

    NOTE: raise it only from code that runs before the step's first state write (step
    preparation, media checks and merging ahead of the decoder stack): the executor re-runs
    the same step without these requests, which must then give the other requests' results.
    """

    def __init__(self, request_ids: Iterable[int | None], message: str) -> None:
        self.request_ids: tuple[int, ...] = tuple(r for r in request_ids if r is not None)
        who = ", ".join(str(r) for r in self.request_ids) or "unknown"
        super().__init__(f"request {who}: {message}")
        self.detail = message
