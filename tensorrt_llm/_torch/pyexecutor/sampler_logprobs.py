"""Logprobs of sampled tokens: computed on the device, carried home in the step's token copy.

For the rows whose request sets `SamplingParams.logprobs` (only those), after sampling:
log_softmax of the raw model logits (float32; vLLM's default `raw_logprobs`: before the logit
processors, temperature and the filters, so a greedy and a sampled request see the same
distribution), the sampled token's logprob and rank (1 + the number of strictly more likely
tokens, so a greedy token is rank 1), and the top-k (`torch.topk`, k = the largest request's).

No extra sync and no extra copy: the values are packed behind the tokens in the one int64
tensor the step copies to the host (`SampledStep.packed`; float32 bit patterns widened to int64,
which round-trips exactly). A step without a logprobs request packs nothing: `packed` is the
token tensor itself and `layout` None, today's path. The host side (`unpack`) splits the copy
back into the token list and one `SampledLogprobs` per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..._utils import async_tensor_h2d
from .llm_request import LlmRequest

if TYPE_CHECKING:
    from .prompt_logprobs import PromptLogprobLayout


class SampledLogprobs(NamedTuple):
    """One generated token's logprobs as the engine sends them (small to pickle; the front end
    turns it into TensorRT-LLM's `dict[token_id, Logprob]`)."""

    logprob: float  # of the sampled token
    rank: int  # of the sampled token, 1 = the most likely
    top_ids: tuple[int, ...]  # the request's k most likely tokens, most likely first
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class LogprobLayout:
    """Where a step's logprob payload sits in the host copy: one block of `2 + 2 * width`
    values per listed row (logprob bits, rank, `width` ids, `width` logprob bits)."""

    num_tokens: int  # tokens at the head of the copy
    rows: tuple[int, ...]  # the sampled rows that asked for logprobs
    ks: tuple[int, ...]  # each listed row's k
    width: int  # the step's widest k


class SampledStep(NamedTuple):
    """A step's sampling output on the device."""

    tokens: torch.Tensor  # int64 [B]: the token pool, the next step's inputs
    packed: torch.Tensor  # int64: what the host copy takes (`tokens` when layout is None)
    layout: LogprobLayout | None
    # Prompt logprobs appended behind the rest (prompt_logprobs.py), None when none asked.
    prompt: PromptLogprobLayout | None = None


def float_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64)


def bits_float(x: torch.Tensor) -> torch.Tensor:
    # The int64 values are sign-extended int32s, so the narrowing cast is exact.
    return x.to(torch.int32).view(torch.float32)


def with_logprobs(
    raw_logits: torch.Tensor, tokens: torch.Tensor, requests: Sequence[LlmRequest]
) -> SampledStep:
    """The step's output, with the logprob payload packed behind `tokens` when any request
    asks for logprobs. `raw_logits` [B, vocab] are the model's (unprocessed); the work runs
    after a CUDA graph's replay, on the same stream, before the next one reuses its memory."""
    wanted = [
        (row, req.sampling_params.logprobs)
        for row, req in enumerate(requests)
        if req.sampling_params.logprobs is not None
    ]
    if not wanted:
        return SampledStep(tokens, tokens, None)  # today's path: nothing launched
    rows = tuple(row for row, _ in wanted)
    ks = tuple(min(int(k), raw_logits.shape[1]) for _, k in wanted)
    width = max(ks)
    if len(rows) == raw_logits.shape[0]:
        logits, picked = raw_logits, tokens
    else:
        index = async_tensor_h2d(list(rows), torch.int64, raw_logits.device)
        logits, picked = raw_logits.index_select(0, index), tokens.index_select(0, index)
    logp = torch.log_softmax(logits.float(), dim=-1)
    token_lp = logp.gather(1, picked.unsqueeze(1))  # [R, 1]
    rank = (logp > token_lp).sum(dim=-1, keepdim=True) + 1
    parts = [float_bits(token_lp), rank]
    if width:
        top_lp, top_ids = logp.topk(width, dim=-1)
        parts += [top_ids, float_bits(top_lp)]
    payload = torch.cat(parts, dim=1).reshape(-1)
    packed = torch.cat([tokens, payload])
    return SampledStep(tokens, packed, LogprobLayout(tokens.shape[0], rows, ks, width))


def unpack(
    host: torch.Tensor, layout: LogprobLayout | None
) -> tuple[list[int], list[SampledLogprobs | None] | None]:
    """(tokens, per-row logprobs or None) from a step's host copy; the logprobs list is None
    when no row asked for them."""
    if layout is None:
        return host.tolist(), None
    n, width = layout.num_tokens, layout.width
    tokens = host[:n].tolist()
    block = host[n:].view(len(layout.rows), 2 + 2 * width)
    token_lp = bits_float(block[:, 0]).tolist()
    ranks = block[:, 1].tolist()
    top_ids = block[:, 2 : 2 + width].tolist()
    top_lp = bits_float(block[:, 2 + width :].contiguous()).tolist()
    out: list[SampledLogprobs | None] = [None] * n
    for i, (row, k) in enumerate(zip(layout.rows, layout.ks, strict=True)):
        out[row] = SampledLogprobs(
            token_lp[i], ranks[i], tuple(top_ids[i][:k]), tuple(top_lp[i][:k])
        )
    return tokens, out
