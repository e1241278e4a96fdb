"""Speculative (rejection) sampling of draft tokens for requests with temperature > 0.

The MTP drafts are the head's argmax, so the draft distribution q is a point mass on d: the
standard rule (accept d with probability min(1, p(d) / q(d)), else sample from the
normalised max(p - q, 0)) becomes: accept d with probability p(d); on a rejection sample from
p with d removed. The emitted token at each position then has exactly the target's
distribution p (temperature-scaled softmax, as `TorchSampler` samples it); after k accepted
drafts the bonus token is the sampler's own draw from the last row.

Everything runs on the device: uniform draws and the residual draws (exponential race,
argmax of p / E) for every checked position at once; the host gets (accepted, residual token)
per position with one copy. A seeded request draws from its own generator, so its output is
reproducible (not equal to the non-speculative one: the draws differ, the distribution not).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...._utils import async_tensor_h2d
from ..llm_request import LlmRequest

_MIN_TEMPERATURE = 1e-5  # the sampler's floor


def wants_sampled_drafts(req: LlmRequest) -> bool:
    """Temperature sampling alone (no top-k, top-p or min-p filter): the rule above then
    needs only the scaled softmax. Processors, logprobs and guided requests take no drafts."""
    p = req.sampling_params
    return (
        not p.is_greedy
        and p.top_k == 0
        and p.top_p >= 1.0
        and p.min_p == 0
        and not p.needs_logit_processing
        and not p.min_tokens
        and p.logprobs is None
        and p.guided_decoding is None
    )


class RejectionSampler:
    """Per-request generators for the seeded requests (released with the request)."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def release(self, request_id: int) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: LlmRequest, device: torch.device) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed + 1)  # not the sampler's stream of the same seed
            self._generators[req.request_id] = gen
        return gen

    def draws(
        self,
        logits: torch.Tensor,
        drafts: torch.Tensor,
        requests: Sequence[LlmRequest],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits: [n, V]` of checked positions, `drafts: [n]` their draft tokens, `requests`
        the owner of each row -> (accepted [n] bool, residual token [n] int64), on the device."""
        dev = logits.device
        temps = async_tensor_h2d(
            [max(r.sampling_params.temperature, _MIN_TEMPERATURE) for r in requests],
            torch.float32,
            dev,
        )
        probs = torch.softmax(logits.float() / temps.unsqueeze(1), dim=-1)
        p_draft = probs.gather(1, drafts.view(-1, 1)).squeeze(1)
        uniform = torch.rand(probs.shape[0], device=dev)
        noise = torch.empty_like(probs).exponential_()
        for row, req in enumerate(requests):
            gen = self._generator(req, dev)
            if gen is not None:
                uniform[row : row + 1].uniform_(generator=gen)
                noise[row].exponential_(generator=gen)
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        accepted = uniform < p_draft
        residual = probs.scatter(1, drafts.view(-1, 1), 0.0)
        return accepted, (residual / noise).argmax(dim=-1)


def sampled_run(
    drafts: Sequence[int], accepted: Sequence[bool], residual: Sequence[int], bonus: int
) -> list[int]:
    """The tokens a sampled verify row emits: drafts while accepted, then the residual draw
    at the first rejection, or the bonus token after all of them."""
    out: list[int] = []
    for draft, ok, res in zip(drafts, accepted, residual, strict=True):
        if not ok:
            out.append(res)
            return out
        out.append(draft)
    out.append(bonus)
    return out
