"""TorchSampler: batched token selection on the device (stop checks: request_lifecycle.py).

`sample` never syncs: per-row knobs go up through pinned staging with non_blocking copies, and
randomness comes from the exponential-race trick (argmax of p / E, E ~ Exp(1)), which draws from
p without a multinomial's host round trip. `to_host` is the step's single sync point.

Order (vLLM/HF): the processors before temperature (`sampler_penalties.py`: logit_bias, bad
words, min_tokens, repetition/presence/frequency penalties; greedy rows too, as they change the
argmax), then temperature, min_p, top-k and top-p. A step whose requests use none of the
processors and min_p takes the plain path: host checks only, no extra kernel.

`sample_step` adds the logprobs of the rows that ask for them (`sampler_logprobs.py`), packed
into the same host copy as the tokens; `step_to_host` copies and splits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from ..._utils import async_tensor_d2h, async_tensor_h2d
from .llm_request import LlmRequest
from .prompt_logprobs import PromptResults, split_step
from .sampler_logprobs import SampledLogprobs, SampledStep, with_logprobs
from .sampler_penalties import LogitProcessors

_MIN_TEMPERATURE = 1e-5  # avoids inf logits for tiny positive temperatures


class TorchSampler:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generators: dict[int, torch.Generator] = {}
        self._processors = LogitProcessors(vocab_size, self.device)

    def why_invalid(self, request: LlmRequest) -> str | None:
        """Why the request's sampling params cannot run on this vocab (the executor fails that
        request alone), or None."""
        return request.sampling_params.why_not_in_vocab(self.vocab_size)

    # ---- device side ---------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, requests: Sequence[LlmRequest]) -> torch.Tensor:
        """One token per row of `logits` [B, V>=vocab_size], as int64 [B] on logits' device."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [num_requests={len(requests)}, vocab], got {tuple(logits.shape)}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, vocab_size={self.vocab_size}")
        logits = logits[:, : self.vocab_size]
        params = [req.sampling_params for req in requests]
        # min_tokens needs the processors only while it still holds off the stop ids.
        if not any(
            p.needs_logit_processing or (p.min_tokens and req.num_sampled_tokens < p.min_tokens)
            for p, req in zip(params, requests, strict=True)
        ):
            return self._pick(logits, requests, params)  # today's path: nothing else launched
        processed, update = self._processors.apply(logits, requests)
        tokens = self._pick(processed, requests, params)
        if update is not None:
            # The history holds the token before the host does (overlap scheduler).
            self._processors.record(update, tokens)
        return tokens

    def sample_step(self, logits: torch.Tensor, requests: Sequence[LlmRequest]) -> SampledStep:
        """`sample` plus the logprobs of the rows that ask for them, computed from these (raw)
        logits; a step where none asks is `sample` alone."""
        tokens = self.sample(logits, requests)
        return with_logprobs(logits[:, : self.vocab_size], tokens, requests)

    def _pick(
        self, logits: torch.Tensor, requests: Sequence[LlmRequest], params: Sequence[Any]
    ) -> torch.Tensor:
        """Greedy rows take the argmax; the others sample after temperature and the filters."""
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            return greedy_tokens  # the common decode case: no H2D, no sort
        dev = logits.device
        greedy = async_tensor_h2d([p.is_greedy for p in params], torch.bool, dev)
        temps = async_tensor_h2d(
            [1.0 if p.is_greedy else max(p.temperature, _MIN_TEMPERATURE) for p in params],
            torch.float32,
            dev,
        )
        scaled = logits.float() / temps.unsqueeze(1)
        if any(not p.is_greedy and p.min_p > 0 for p in params):
            scaled = self._min_p_filtered(scaled, params)
        needs_filter = any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params)
        if needs_filter:
            probs, order = self._filtered_sorted_probs(scaled, params)
        else:
            probs, order = torch.softmax(scaled, dim=-1), None
        noise = self._exponential_noise(probs.shape, requests, dev)
        if order is not None:
            # Each token keeps its own draw (vocab order), so a seeded row picks the same token
            # whether or not a companion's top-k/top-p sends the batch down the sorted path.
            noise = noise.gather(1, order)
        choice = (probs / noise).argmax(dim=-1)
        sampled = choice if order is None else order.gather(1, choice.unsqueeze(1)).squeeze(1)
        return torch.where(greedy, greedy_tokens, sampled)

    @staticmethod
    def _min_p_filtered(scaled: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
        """Drop tokens whose probability is below min_p times the row's top one (vLLM, after
        temperature). The ratio is what top-k/top-p renormalising keeps, so order with those
        does not matter. min_p == 0 rows: the threshold 0 drops nothing."""
        min_p = async_tensor_h2d(
            [0.0 if p.is_greedy else float(p.min_p) for p in params], torch.float32, scaled.device
        )
        probs = torch.softmax(scaled, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        return scaled.masked_fill(probs < floor, float("-inf"))

    def _filtered_sorted_probs(
        self, scaled: torch.Tensor, params: Sequence[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities in descending order with top-k then top-p applied (renormalised)."""
        vocab = scaled.shape[1]
        dev = scaled.device
        top_k = async_tensor_h2d(
            [vocab if p.top_k == 0 or p.top_k > vocab else p.top_k for p in params],
            torch.int64,
            dev,
        )
        # top_p == 1 rows get 2.0 so float rounding in the cumsum can never drop their tail.
        top_p = async_tensor_h2d(
            [float(p.top_p) if p.top_p < 1.0 else 2.0 for p in params], torch.float32, dev
        )
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before
        # it already does. The first token is always kept (its prefix mass is 0).
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs, order

    def _exponential_noise(
        self, shape: torch.Size, requests: Sequence[LlmRequest], device: torch.device
    ) -> torch.Tensor:
        """Exp(1) draws; a seeded request's row comes from its own generator only.

        That makes a seeded request's tokens independent of its batch companions.
        """
        noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
        for row, req in enumerate(requests):
            params = req.sampling_params
            if params.seed is None or params.is_greedy:
                continue
            gen = self._generators.get(req.request_id)
            if gen is None:
                gen = torch.Generator(device=device)
                gen.manual_seed(params.seed)
                self._generators[req.request_id] = gen
            noise[row].exponential_(generator=gen)
        # A zero draw would make p / E = 0 / 0 = NaN for a filtered token, and argmax picks NaN.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def to_host(self, tokens: torch.Tensor) -> list[int]:
        """Bring the sampled tokens to the host with one copy (the step's sync point)."""
        if tokens.device.type == "cpu":
            return tokens.tolist()
        host, done = async_tensor_d2h(tokens)
        # A device tensor's copy always comes with its event (None only for CPU tensors).
        cast("torch.cuda.Event", done).synchronize()
        return host.tolist()

    def step_to_host(
        self, step: SampledStep
    ) -> tuple[list[int], list[SampledLogprobs | None] | None]:
        """`to_host` of a `sample_step` output: its one copy (tokens and logprobs together),
        split into the tokens and the per-row logprobs (None when no row asked)."""
        tokens, logprobs, _ = self.step_results(step)
        return tokens, logprobs

    def step_results(
        self, step: SampledStep
    ) -> tuple[list[int], list[SampledLogprobs | None] | None, PromptResults | None]:
        """`step_to_host` plus the prompt logprobs the step carries (`prompt_logprobs.py`),
        from the same single copy."""
        if step.layout is None and step.prompt is None:
            return self.to_host(step.tokens), None, None
        packed = step.packed
        if packed.device.type != "cpu":
            host, done = async_tensor_d2h(packed)
            cast("torch.cuda.Event", done).synchronize()
            packed = host
        return split_step(packed, step)

    def release(self, request_id: int) -> None:
        """Drop a request's generator and token history (called for finished requests)."""
        self._generators.pop(request_id, None)
        self._processors.release(request_id)
