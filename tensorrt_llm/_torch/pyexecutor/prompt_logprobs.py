"""Prompt logprobs (vLLM's `prompt_logprobs`): computed on the device during prefill.

For a request with `SamplingParams.prompt_logprobs = k`, prompt position p >= 1 gets the
logprob of prompt token p given tokens < p (raw log_softmax, float32, as the output logprobs),
its rank (1 + the strictly more likely tokens) and the k most likely tokens. Position 0 has no
entry. The logits at step row q predict prompt token q + 1, so a chunk [begin, end) gives the
entries of tokens begin + 1 .. end (capped at the prompt's end: the last prompt position
predicts the first output token, which the sampler handles). The last row of chunk i thus
predicts the first token of chunk i + 1: the target ids come from the prompt on the host.
Image / video placeholder tokens are prompt tokens and get entries like any other (vLLM does
the same).

Cost only for the requests that ask: the engine normally runs the LM head over the last token
of each request; a step with such a request keeps the stack's hidden states of every token
(`EngineModel.forward_hidden`) and runs the LM head over the asked rows in slices of at most
`SLICE_BYTES` of float32 logits, so a long prompt never holds `[L, vocab]` at once.

No extra copy or sync: the entries (the output logprobs' row format: logprob bits, rank, top
ids, top logprob bits) are appended to the step's single packed D2H tensor
(`attach`); `split_step` takes the host copy apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..._utils import async_tensor_h2d
from .llm_request import LlmRequest
from .sampler_logprobs import SampledLogprobs, SampledStep, bits_float, float_bits, unpack

# Float32 logits of one slice of prompt rows (the LM head's output and log_softmax take about
# as much again): 256 MiB is ~440 rows of a 152k vocabulary.
SLICE_BYTES = 256 << 20


@dataclass(frozen=True)
class PromptLogprobLayout:
    """Host side of a step's prompt entries: who asked, how many rows each, where they sit."""

    requests: tuple[LlmRequest, ...]  # the context requests asking, in step order
    counts: tuple[int, ...]  # entries each gets this step (its chunk's positions)
    ks: tuple[int, ...]  # each request's k
    width: int  # the step's widest k
    start: int = 0  # offset of the entries in the step's packed host copy (set by `attach`)

    @property
    def num_rows(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class PromptLogprobsPlan:
    """What one step computes: the step rows whose logits are wanted and their target ids."""

    layout: PromptLogprobLayout
    rows: torch.Tensor  # int64 [N] on the device: step token rows
    targets: torch.Tensor  # int64 [N] on the device: the prompt token each row predicts


def plan_prompt_logprobs(
    ctx: Sequence[LlmRequest], device: torch.device
) -> PromptLogprobsPlan | None:
    """The plan of a step whose context requests are `ctx` (chunks as scheduled, step rows in
    that order), or None when none of them asks: the step then runs as before."""
    if all(req.sampling_params.prompt_logprobs is None for req in ctx):
        return None
    asking: list[LlmRequest] = []
    counts: list[int] = []
    ks: list[int] = []
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    offset = 0
    for req in ctx:
        begin = req.context_current_position
        size = req.context_chunk_size
        k = req.sampling_params.prompt_logprobs
        stop = min(begin + size, req.prompt_len - 1)  # the last position predicts an output
        if k is not None and stop > begin:
            n = stop - begin
            asking.append(req)
            counts.append(n)
            ks.append(int(k))
            rows.append(np.arange(offset, offset + n, dtype=np.int64))
            targets.append(req.prompt_token_array[begin + 1 : stop + 1])
        offset += size
    if not asking:  # e.g. one-token prompts: nothing to predict
        return None
    host = torch.from_numpy(np.stack([np.concatenate(rows), np.concatenate(targets)]))
    both = async_tensor_h2d(host, torch.int64, device)  # one H2D for the step
    layout = PromptLogprobLayout(tuple(asking), tuple(counts), tuple(ks), max(ks))
    return PromptLogprobsPlan(layout, both[0], both[1])


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    plan: PromptLogprobsPlan,
    lm_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> torch.Tensor:
    """int64 `[N * (2 + 2 * width)]` on the device: one entry row per planned position.

    `hidden` [T, H] are the step's final-normed hidden states; `lm_logits` is the model's LM
    head. Runs slice by slice (host-known sizes, no sync)."""
    width = plan.layout.width
    num = plan.rows.shape[0]
    out = torch.empty(num, 2 + 2 * width, dtype=torch.int64, device=hidden.device)
    step = max(1, SLICE_BYTES // (4 * vocab_size))
    for begin in range(0, num, step):
        end = min(begin + step, num)
        rows = hidden.index_select(0, plan.rows[begin:end])
        logp = torch.log_softmax(lm_logits(rows)[:, :vocab_size].float(), dim=-1)
        token_lp = logp.gather(1, plan.targets[begin:end].unsqueeze(1))  # [S, 1]
        block = out[begin:end]
        block[:, :1] = float_bits(token_lp)
        block[:, 1:2] = (logp > token_lp).sum(dim=-1, keepdim=True) + 1
        if width:
            top_lp, top_ids = logp.topk(width, dim=-1)
            block[:, 2 : 2 + width] = top_ids
            block[:, 2 + width :] = float_bits(top_lp)
    return out.reshape(-1)


def attach(step: SampledStep, payload: torch.Tensor, layout: PromptLogprobLayout) -> SampledStep:
    """`step` with the prompt entries appended to its packed copy (still one D2H)."""
    start = step.packed.shape[0]
    packed = torch.cat([step.packed, payload])
    placed = PromptLogprobLayout(layout.requests, layout.counts, layout.ks, layout.width, start)
    return SampledStep(step.tokens, packed, step.layout, placed)


PromptResults = list[tuple[LlmRequest, list[SampledLogprobs]]]


def split_step(
    host: torch.Tensor, step: SampledStep
) -> tuple[list[int], list[SampledLogprobs | None] | None, PromptResults | None]:
    """(tokens, per-row output logprobs or None, prompt entries per asking request or None)
    from the host copy of `step.packed`."""
    prompt = step.prompt
    if prompt is None:
        return (*unpack(host, step.layout), None)
    tokens, logprobs = unpack(host[: prompt.start], step.layout)
    width = prompt.width
    block = host[prompt.start :].view(prompt.num_rows, 2 + 2 * width)
    token_lp = bits_float(block[:, 0]).tolist()
    ranks = block[:, 1].tolist()
    top_ids = block[:, 2 : 2 + width].tolist()
    top_lp = bits_float(block[:, 2 + width :].contiguous()).tolist()
    results: PromptResults = []
    row = 0
    for req, count, k in zip(prompt.requests, prompt.counts, prompt.ks, strict=True):
        entries = [
            SampledLogprobs(token_lp[i], ranks[i], tuple(top_ids[i][:k]), tuple(top_lp[i][:k]))
            for i in range(row, row + count)
        ]
        results.append((req, entries))
        row += count
    return tokens, logprobs, results
