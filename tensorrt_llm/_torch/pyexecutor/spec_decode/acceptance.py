"""Greedy acceptance of draft tokens and the tokens a verify row emits (host side).

Target position j of a verify row (the last real token, then drafts d_1..d_m) predicts the
token after it, g_j. Drafts are accepted while d_{j+1} == g_j; the row then emits
g_0..g_a (the a accepted drafts and the bonus token g_a), one at a time through the same stop
checks as a plain decode step, so an end id, stop token or max_tokens inside the run cuts it
exactly where non-speculative decoding would stop.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..llm_request import LlmRequest
from ..request_lifecycle import check_token_stop


def num_accepted(drafts: Sequence[int], target: Sequence[int]) -> int:
    """Length of the longest prefix of `drafts` equal to the target's greedy tokens.

    `target` holds g_0..g_m (one more than `drafts`: the bonus position)."""
    if len(target) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens")
    accepted = 0
    for draft, token in zip(drafts, target, strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted


def emit_accepted(req: LlmRequest, tokens: Sequence[int]) -> int:
    """Append `tokens` (accepted drafts, then the bonus token) until a stop condition ends
    the request; returns how many were appended."""
    emitted = 0
    for token in tokens:
        if req.is_finished:
            break
        req.add_new_token(token)
        check_token_stop(req, token)
        emitted += 1
    return emitted


def wants_drafts(req: LlmRequest) -> bool:
    """Whether a request takes greedy drafts: greedy, with nothing that reads each sampled
    row (logit processors, min_tokens, logprobs, structured output). Temperature sampling
    drafts through rejection.py; the others verify no draft and sample as usual."""
    params = req.sampling_params
    return (
        params.is_greedy
        and not params.needs_logit_processing
        and not params.min_tokens
        and params.logprobs is None
        and params.guided_decoding is None
    )


def draft_budget(req: LlmRequest, max_draft_len: int) -> int:
    """Drafts the request's next step may verify: one token of max_tokens is always left
    for the bonus token, so the step never writes KV past prompt + max_tokens."""
    left = req.sampling_params.max_tokens - req.num_generated_tokens - 1
    return max(0, min(max_draft_len, left))
