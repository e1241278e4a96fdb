"""What a step's results do to its requests: the executor's only way to change them.

The sampler picks tokens on the device and nothing else. After the step (or, with the overlap
scheduler, once the step's tokens reach the host) the executor calls these functions, so token
appends, token-id stops and the release of prefilled media happen in one place. Stop strings are
text: the front end finds them while detokenizing and cancels the request (`llmapi/outputs.py`),
so the engine never decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .llm_request import LlmRequest
from .scheduler import ScheduledRequests


def sample_rows(scheduled: ScheduledRequests) -> list[int]:
    """Rows of the step that give a token, in request order: each context request whose chunk
    ends the prompt, then every generation request."""
    ctx = scheduled.context_requests
    rows = [i for i, req in enumerate(ctx) if req.is_last_context_chunk]
    rows.extend(range(len(ctx), len(ctx) + len(scheduled.generation_requests)))
    return rows


def apply_step_results(
    scheduled: ScheduledRequests,
    sampled: Sequence[LlmRequest],
    new_tokens: Sequence[int],
    logprobs: Sequence[Any] | None = None,
    prompt_logprobs: Sequence[tuple[LlmRequest, list[Any]]] | None = None,
) -> None:
    """Everything a finished step (tokens on the host) does to its requests: media of finished
    prefills released, chunks advanced, prompt logprob entries appended, tokens appended and
    token stops applied."""
    release_prefilled_media(scheduled)
    advance_context_chunks(scheduled)
    apply_prompt_logprobs(prompt_logprobs)
    apply_new_tokens(sampled, new_tokens, logprobs=logprobs)


def apply_prompt_logprobs(results: Sequence[tuple[LlmRequest, list[Any]]] | None) -> None:
    """Append each request's prompt logprob entries of a step (steps are applied in order,
    so chunks arrive in order); a request that finished meanwhile takes none."""
    for req, entries in results or ():
        if not req.is_finished:
            req.prompt_logprobs.extend(entries)


def apply_new_tokens(
    requests: Sequence[LlmRequest],
    new_tokens: Sequence[int],
    in_flight: bool = False,
    logprobs: Sequence[Any] | None = None,
) -> None:
    """Append each request's token (and its logprob entry, `logprobs[i]` when not None: the
    sampler's per-row output) and apply its token-id stop conditions.

    `in_flight`: the tokens were counted at launch (`LlmRequest.add_in_flight_token`) and now
    resolve. A context request whose chunk did not end the prompt produced no real token, and a
    request that already finished (cancelled, failed, stopped) takes none: both are skipped.
    """
    if len(requests) != len(new_tokens):
        raise ValueError(f"{len(requests)} requests but {len(new_tokens)} tokens")
    if logprobs is not None and len(logprobs) != len(new_tokens):
        raise ValueError(f"{len(new_tokens)} tokens but {len(logprobs)} logprob entries")
    for i, (req, token) in enumerate(zip(requests, new_tokens, strict=True)):
        if req.is_finished:
            continue
        if req.is_context_init and not req.is_last_context_chunk:
            continue
        if in_flight:
            req.resolve_in_flight_token(token)
        else:
            req.add_new_token(token)
        # NOTE: appended with the token and skipped with it, so entries and output tokens
        # stay one to one (a response slices both the same way).
        if logprobs is not None and logprobs[i] is not None:
            req.output_logprobs.append(logprobs[i])
        check_token_stop(req, token)


def check_token_stop(req: LlmRequest, token: int) -> None:
    """Finish `req` on its end id, a stop token, or max_tokens (in that order)."""
    params = req.sampling_params
    if not params.ignore_eos and params.end_id is not None and token == params.end_id:
        req.stop_reason = token
        req.finish("stop")
        return
    if token in params.stop_token_set:
        req.stop_reason = token
        req.finish("stop")
        return
    if req.num_generated_tokens >= params.max_tokens:
        req.finish("length")


def advance_context_chunks(scheduled: ScheduledRequests) -> None:
    """Mark the prefilled chunks of context requests whose prompt is not done yet."""
    for req in scheduled.context_requests:
        if not req.is_last_context_chunk:
            req.move_to_next_context_chunk()


def release_prefilled_media(scheduled: ScheduledRequests) -> None:
    """Drop pixels and embeddings of requests whose last prefill chunk ran: their mRoPE
    delta now lives in the seq-slot cache, and decode steps need nothing else."""
    for req in scheduled.context_requests:
        if req.is_last_context_chunk and req.multimodal_params is not None:
            req.multimodal_params.strip_for_generation()
