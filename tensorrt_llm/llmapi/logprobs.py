"""TensorRT-LLM's logprob types (`Logprob`, `TokenLogprobs`) and the engine entries -> them.

The engine sends one compact entry per generated token (`SampledLogprobs`: the sampled token's
logprob and rank, the top-k ids and logprobs); the front end builds the dicts here, in the
consumer's thread, so the engine loop and the process boundary carry tuples only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias


@dataclass(slots=True)
class Logprob:
    """A token's log probability and its rank in the vocabulary (1 = the most likely)."""

    logprob: float
    rank: int | None = None


# One dict per token: token id -> Logprob, the sampled token first, then the top-k.
TokenLogprobs: TypeAlias = list[dict[int, Logprob]]
# vLLM's prompt logprobs: one entry per prompt position, None for the first (nothing before it
# to predict it from), then a dict as above with the prompt token first.
PromptLogprobs: TypeAlias = list[dict[int, Logprob] | None]


def token_logprob_dict(token_id: int, entry: Any) -> dict[int, Logprob]:
    """The dict of one generated token from its engine entry (vLLM's shape: the sampled token
    plus the k most likely; k entries when it is among them, k + 1 otherwise)."""
    out = {token_id: Logprob(entry.logprob, entry.rank)}
    for position, (tid, value) in enumerate(zip(entry.top_ids, entry.top_logprobs, strict=True)):
        out[tid] = Logprob(value, position + 1)
    return out


def to_token_logprobs(token_ids: Sequence[int], entries: Iterable[Any]) -> TokenLogprobs:
    return [token_logprob_dict(t, e) for t, e in zip(token_ids, entries, strict=True)]


def to_prompt_logprobs(prompt_ids: Sequence[int], entries: Sequence[Any]) -> PromptLogprobs:
    """The engine's entries of prompt positions 1..L-1 -> vLLM's list (None at position 0)."""
    if len(entries) != len(prompt_ids) - 1:
        raise ValueError(f"{len(entries)} prompt logprob entries for {len(prompt_ids)} tokens")
    out: PromptLogprobs = [None]
    out.extend(token_logprob_dict(t, e) for t, e in zip(prompt_ids[1:], entries, strict=True))
    return out
