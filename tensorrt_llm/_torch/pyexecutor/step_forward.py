"""One step on the device: build the InputBatch, run the model, sample the rows that give a
token. No host sync happens here; the caller fetches the results (`sampler.step_results`).

Kept apart from py_executor.py, which owns the loop and the request lifecycle: this is the
part of a step that the plain, overlap and MTP paths share, and it only reads the parts it is
handed (engine, scheduler, sampler, guided decoder), never the executor's request state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..._utils import async_tensor_h2d
from .prompt_logprobs import attach
from .sampler_logprobs import SampledStep

if TYPE_CHECKING:
    from .guided_decoder import GuidedDecoder
    from .llm_request import LlmRequest
    from .model_engine import PyTorchModelEngine
    from .sampler import TorchSampler
    from .scheduler import ScheduledRequests, SimpleScheduler


def forward_and_sample(
    engine: PyTorchModelEngine,
    scheduler: SimpleScheduler,
    sampler: TorchSampler,
    guided: GuidedDecoder | None,
    scheduled: ScheduledRequests,
    before_sample: Callable[[], None] | None = None,
) -> tuple[list[LlmRequest], SampledStep | None]:
    """Build the step's InputBatch, run it and sample on the device; returns (sampled
    requests, device tokens with the logprobs rows asked for). Each token is also kept at
    its seq slot (SlotState). `before_sample` runs once the forward is launched, before
    the guided masks are built (the overlap executor accepts the previous step's tokens
    there while the GPU runs this forward).

    Rows that give a real token are the generation rows and the context rows whose chunk
    reaches the end of the prompt (`InputBatch.sample_rows`); the others are dropped
    before sampling. `guided` hooks return at once while no request is guided.
    """
    if guided is not None:
        guided.prepare(scheduled)  # before any state is written: see RequestInputError
    batch = engine.build_batch(scheduled)
    plan = batch.prompt_logprobs
    # Without a prompt-logprobs request the step is exactly `run` (graphs, last tokens).
    logits, prompt = (engine.run(batch), None) if plan is None else engine.run_step(batch)
    rows = batch.sample_rows
    everyone = scheduled.all_requests  # built once: the property makes a new list
    sampled = [everyone[i] for i in rows]
    reuse = getattr(scheduler, "reuse", None)
    if reuse is not None:
        # The step's KV writes are queued ahead of anything a later step runs: its full
        # blocks may be found from now on (before the results change the requests).
        reuse.register_step(scheduled)
    if not sampled:
        if prompt is None or plan is None:
            return sampled, None
        # Only non-final chunks ran: the step's copy carries their prompt entries alone.
        none = torch.empty(0, dtype=torch.int64, device=logits.device)
        return sampled, attach(SampledStep(none, none, None), prompt, plan.layout)
    if before_sample is not None:
        before_sample()
    slots = batch.attn_metadata.seq_slots
    if len(rows) != logits.shape[0]:
        index = async_tensor_h2d(rows, torch.int64, logits.device)
        logits = logits.index_select(0, index)
        slots = slots.index_select(0, index)
    if guided is not None:
        logits = guided.mask_logits(logits, sampled)
    step = sampler.sample_step(logits, sampled)
    engine.slot_state.record_tokens(slots, step.tokens)
    if prompt is not None and plan is not None:
        step = attach(step, prompt, plan.layout)
    return sampled, step
