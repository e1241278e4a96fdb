"""`ScheduledRequests`: one step's work as the scheduler hands it to the executor (which requests
run, and which were preempted or failed while it was picked). `SimpleScheduler` (scheduler.py)
builds it; the engine, the sampler and the resource managers read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .llm_request import LlmRequest


@dataclass
class ScheduledRequests:
    """One step's work. The engine packs context requests first, then generation requests."""

    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    # Sent back to waiting this step (their blocks are free already).
    preempted: list[LlmRequest] = field(default_factory=list)
    # Can never get their blocks (error set, resources freed): the executor finishes them.
    failed: list[LlmRequest] = field(default_factory=list)
    # A victim was needed but had a token in flight: sync the pending step, schedule again.
    preemption_deferred: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def num_context_tokens(self) -> int:
        return sum(req.context_chunk_size for req in self.context_requests)

    @property
    def num_tokens(self) -> int:
        return self.num_context_tokens + len(self.generation_requests)

    @property
    def is_empty(self) -> bool:
        return self.batch_size == 0

    @property
    def all_requests(self) -> list[LlmRequest]:
        """Requests in batch order (context first)."""
        return self.context_requests + self.generation_requests
