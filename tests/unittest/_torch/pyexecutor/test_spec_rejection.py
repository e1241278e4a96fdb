"""Rejection sampling of point-mass drafts: the emitted token has the target's distribution
(temperature-scaled softmax), whatever the draft; seeded rows repeat their draws."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.spec_decode.rejection import (
    RejectionSampler,
    sampled_run,
    wants_sampled_drafts,
)
from tensorrt_llm.sampling_params import SamplingParams

TRIALS = 200_000


def _req(rid: int = 0, **kwargs: object) -> LlmRequest:
    return LlmRequest(rid, [1, 2], SamplingParams(**kwargs))  # type: ignore[arg-type]


def _first_tokens(logits: torch.Tensor, draft: int, temperature: float) -> torch.Tensor:
    """The token each of TRIALS verify rows emits at one checked position."""
    req = _req(temperature=temperature)
    rows = logits.expand(TRIALS, -1)
    drafts = torch.full((TRIALS,), draft, dtype=torch.int64)
    accepted, residual = RejectionSampler().draws(rows, drafts, [req] * TRIALS)
    return torch.where(accepted, drafts, residual)


@pytest.mark.parametrize("draft", [0, 3, 7])
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_emitted_token_follows_the_target(draft: int, temperature: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 2
    target = torch.softmax(logits[0] / temperature, dim=-1)
    got = torch.bincount(_first_tokens(logits, draft, temperature), minlength=8) / TRIALS
    # Total variation: sampling noise at 200k draws is ~0.003.
    assert 0.5 * (got - target).abs().sum() < 0.01
    # The control: keeping every draft would put all the mass on it.
    assert target[draft] < 0.9


def test_seeded_rows_repeat_their_draws() -> None:
    logits = torch.randn(4, 16)
    drafts = torch.tensor([1, 2, 3, 4])

    def run() -> tuple[list[bool], list[int]]:
        sampler = RejectionSampler()
        reqs = [_req(rid, temperature=1.0, seed=11) for rid in range(4)]
        accepted, residual = sampler.draws(logits, drafts, reqs)
        return accepted.tolist(), residual.tolist()

    assert run() == run()


def test_sampled_run() -> None:
    assert sampled_run([5, 6, 7], [True, False, True], [9, 8, 1], bonus=4) == [5, 8]
    assert sampled_run([5, 6], [True, True], [9, 8], bonus=4) == [5, 6, 4]
    assert sampled_run([5], [False], [2], bonus=4) == [2]


@pytest.mark.parametrize(
    ("kwargs", "wants"),
    [
        ({"temperature": 0.8}, True),
        ({"temperature": 0}, False),  # greedy: acceptance.py
        ({"temperature": 0.8, "top_p": 0.9}, False),
        ({"temperature": 0.8, "top_k": 5}, False),
        ({"temperature": 0.8, "min_p": 0.1}, False),
        ({"temperature": 0.8, "logprobs": 0}, False),
    ],
)
def test_which_sampled_requests_draft(kwargs: dict[str, object], wants: bool) -> None:
    assert wants_sampled_drafts(_req(**kwargs)) is wants
