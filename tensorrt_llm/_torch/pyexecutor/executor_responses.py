"""What the executor loop publishes about its requests: one request's response (the tokens it
made since the last one) and the stats gauges read from the live state.

Pure functions of the state they are given: `PyExecutor` holds the stats lock around them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .executor_types import ExecutorStats, LlmResponse, RequestMetrics
from .llm_request import LlmRequest

if TYPE_CHECKING:
    from .resource_manager import KVCacheManager, SeqSlotManager


def response_of(req: LlmRequest, new: list[int]) -> LlmResponse:
    """The response carrying `new` output tokens of `req` (and its final state once finished)."""
    return LlmResponse(
        request_id=req.request_id,
        new_token_ids=list(new),
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        error=req.error,
        error_code=req.error_code,
        new_logprobs=req.logprobs_tail(len(new)),
        prompt_logprobs=req.take_prompt_logprobs(),
        num_cached_tokens=req.num_cached_tokens,
        metrics=metrics_of(req) if req.is_finished else None,
    )


def metrics_of(req: LlmRequest) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=req.arrival_time,
        accepted_time=req.accepted_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        finished_time=req.finish_time,
        num_context_steps=req.num_context_steps,
    )


def count_finished(stats: ExecutorStats, req: LlmRequest) -> None:
    """Count a request that just finished under its outcome."""
    if req.finish_reason == "error":
        stats.num_failed += 1
    elif req.finish_reason == "cancelled":
        stats.num_cancelled += 1
    else:
        stats.num_completed += 1


def refresh_gauges(
    stats: ExecutorStats,
    active: Sequence[LlmRequest],
    kv: KVCacheManager,
    slots: SeqSlotManager,
    num_queued: int,
) -> None:
    """Set the gauges of `stats` from the live state (`num_queued`: commands not handled yet)."""
    running = sum(1 for req in active if req.seq_slot is not None)
    stats.num_running = running
    stats.num_waiting = len(active) - running + num_queued
    stats.num_free_seq_slots = slots.num_free
    stats.num_total_seq_slots = slots.max_num_slots
    stats.kv_cache_usage = kv.usage
    stats.num_free_kv_blocks = kv.num_free_blocks
    stats.num_total_kv_blocks = kv.num_blocks
    prefix = getattr(kv, "prefix_cache_stats", None)
    if prefix is not None:
        stats.prefix_cache_queries = prefix.queries
        stats.prefix_cache_hits = prefix.hits
