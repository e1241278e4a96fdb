"""The executor's public types: responses, stats snapshots, and how a response is delivered.

Shared by `PyExecutor` (py_executor.py) and the process-mode proxy (executor/proxy.py).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SHUTDOWN_ERROR = "the executor was shut down before the request finished"


@dataclass(frozen=True)
class RequestMetrics:
    """Where one request's time went, sent with its final response (vLLM's `RequestOutput.metrics`).

    `time.perf_counter()` stamps in seconds. On Linux that clock is CLOCK_MONOTONIC, one clock
    for every process of the host, so stamps taken in an engine process compare with the
    caller's. arrival: the engine request was built (after tokenizing and image processing);
    accepted: the executor loop took it in; first_scheduled: its first prompt chunk was
    scheduled; first_token / finished: as named (None when it never got there).
    `num_context_steps`: the steps that ran a chunk of its prompt (a resume after preemption
    counts again).
    """

    arrival_time: float
    accepted_time: float | None
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_context_steps: int


@dataclass
class LlmResponse:
    """One update of one request: tokens generated since the previous response."""

    request_id: int
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # see llm_request.FINISH_REASONS
    stop_reason: int | None = None  # the stop token id (stop strings are the front end's)
    error: str | None = None
    error_code: str | None = None  # llm_request.ERROR_CODES, set with `error`
    # One sampler_logprobs.SampledLogprobs per new token when the request asks for logprobs.
    new_logprobs: list[Any] | None = None
    # With prompt_logprobs: every prompt entry (SampledLogprobs of positions 1..L-1), once, in
    # the first response after the prompt's last chunk.
    prompt_logprobs: list[Any] | None = None
    # Prompt tokens whose KV the request's first admission took from the prefix cache.
    num_cached_tokens: int = 0
    # Set on the final response only.
    metrics: RequestMetrics | None = None


@dataclass
class ExecutorStats:
    """A snapshot for metrics, published after every step."""

    num_running: int = 0  # admitted requests (hold a seq slot)
    num_waiting: int = 0  # accepted, not admitted yet
    num_free_seq_slots: int = 0
    num_total_seq_slots: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    num_free_kv_blocks: int = 0
    num_total_kv_blocks: int = 0
    num_steps: int = 0
    num_completed: int = 0  # finished normally (stop / length)
    num_failed: int = 0  # errors, including validation failures
    num_cancelled: int = 0
    # Requests sent back to waiting to be recomputed because the KV pool ran out (scheduler.py).
    num_preemptions: int = 0
    # Prefix cache, in tokens: prompt tokens looked up at first admission, and of those the
    # ones whose KV came from the cache (0 and 0 with block reuse off).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    last_step_num_tokens: int = 0
    last_step_time_s: float = 0.0


ResponseCallback = Callable[[LlmResponse], None]


def deliver_response(
    callback: ResponseCallback | None, response: LlmResponse, responses: queue.Queue
) -> None:
    """Hand a response to its callback (errors logged, never raised into the loop), or to the
    `responses` queue when the request has none."""
    if callback is None:
        responses.put(response)
        return
    try:
        callback(response)
    except Exception:
        logger.exception("response callback of request %s raised", response.request_id)
