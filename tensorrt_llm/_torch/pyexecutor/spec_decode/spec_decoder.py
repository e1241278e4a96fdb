"""SpecDecoder: one speculative engine step, called from `PyExecutor._run_step`.

The step, top to bottom:
1. save the recurrent rows of the requests that verify drafts (rollback.py);
2. one target forward over the context chunks and the verify rows (chunk_batch.py), to the
   final-normed hidden states; one LM head over each request's last row plus the rows that
   check drafts;
3. sample the last rows as a plain step does (processors, logprobs, guided masks); the check
   rows give greedy argmax tokens and, for temperature requests, the rejection draws
   (rejection.py); one host copy of both unless a row asks for logprobs;
4. accept drafts and append tokens with the usual stop checks (acceptance.py);
5. draft the next k tokens with the MTP head (mtp_drafter.py) from this step's hidden states;
6. roll the recurrent state back for requests that rejected a draft: the recurrence alone
   from the saved rows, over what the verify forward recorded, where it can; else restore
   and a replay forward (rollback.py).

KV rollback needs nothing: a request's length advances by the emitted tokens only, and the
next step's writes overwrite the rejected positions.

Tensor parallelism (`link` set, rank 0): the target forward, the MTP passes and the replay
are each sent to the worker ranks just before they run here, which run them too
(tp_spec.py); the rollback's save and restore go with them, so every rank's recurrent state
is rolled back alike. Everything else (sampling, acceptance) is rank 0's alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...._utils import async_tensor_h2d
from ...modules.gated_delta_net_rows import RECORD_MAX_BYTES, RowsRecord, covers
from ..prompt_logprobs import attach, compute_prompt_logprobs
from ..request_errors import RequestInputError
from ..request_lifecycle import (
    advance_context_chunks,
    apply_new_tokens,
    apply_prompt_logprobs,
    release_prefilled_media,
)
from ..sampler_logprobs import SampledStep
from .acceptance import emit_accepted, num_accepted, wants_drafts
from .chunk_batch import ChunkRow, build_chunk_batch
from .draft_graphs import DraftGraphRunner
from .drafting import Drafting, DraftOverride
from .mtp_drafter import MTPDrafter
from .rejection import RejectionSampler, sampled_run
from .rollback import RecurrentRollback, StateSnapshot
from .rollback_graphs import RollbackGraphRunner
from .verify_batch import build_verify_batch, uniform_verify_len
from .verify_rows import DraftChecks, VerifyRow, check_rows, unpack_checks

if TYPE_CHECKING:
    from ...input_batch import InputBatch
    from ..llm_request import LlmRequest
    from ..py_executor import PyExecutor
    from ..scheduler import ScheduledRequests
    from .tp_spec import SpecLink

logger = logging.getLogger(__name__)

# (drafts a verify row holds) -> how many it accepts, whatever the target says
# (trtllm-bench's oracle / rejected modes); None: the target decides.
AcceptOverride = Callable[[int], int]


@dataclass
class SpecStats:
    """Counters over the engine's life: acceptance length = accepted / verify rows + 1."""

    num_verify_rows: int = 0  # generation rows that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_replays: int = 0  # rows whose recurrent state was rolled back

    @property
    def acceptance_length(self) -> float:
        """Tokens a verify row emits on average (1 + accepted drafts)."""
        if not self.num_verify_rows:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verify_rows


class SpecDecoder(Drafting):
    def __init__(self, executor: PyExecutor, drafter: MTPDrafter, max_draft_len: int) -> None:
        engine = executor.model_engine
        self.engine = engine
        self.drafter = drafter
        self.max_draft_len = max_draft_len
        self.rollback = RecurrentRollback(engine.model, engine.max_batch_size)
        self.drafts: dict[int, list[int]] = {}  # next step's drafts, by request id
        self.draft_override: DraftOverride | None = None
        self.accept_override: AcceptOverride | None = None
        self.stats = SpecStats()
        self.rejection = RejectionSampler()
        # The draft passes and the rollback of verify-graph steps as CUDA graphs (setup.py;
        # None: eager).
        self.draft_graphs: DraftGraphRunner | None = None
        self.rollback_graphs: RollbackGraphRunner | None = None
        # Tensor parallelism, rank 0: sends each forward of a step to the workers (setup.py).
        self.link: SpecLink | None = None

    @torch.inference_mode()
    def run_step(
        self,
        executor: PyExecutor,
        scheduled: ScheduledRequests,
        before_sync: Callable[[], None] | None = None,
    ) -> None:
        """One speculative step. `before_sync` runs once the target forward and the sampling
        are queued, before the host waits for their results: the overlap executor delivers the
        previous step's streaming responses there, while the device runs this step."""
        engine = self.engine
        ctx = list(scheduled.context_requests)
        if self.link is not None:
            _refuse_prompt_logprobs(ctx)
        guided = executor.guided_decoder
        if guided is not None:
            guided.prepare(scheduled)
        verify = [
            VerifyRow(req, self._drafts_for(req), req.num_tokens - 1, req.output_token_ids[-1])
            for req in scheduled.generation_requests
        ]
        rows = [ChunkRow(v.request, [v.token, *v.drafts], v.start) for v in verify]
        # Before the chunks advance: (begin, size, ends the context) of each context request.
        chunks = [
            (r.context_current_position, r.context_chunk_size, r.is_last_context_chunk) for r in ctx
        ]
        # A step of verify rows alone, all of one length, that a verify CUDA graph takes runs
        # them as generation rows (verify_batch.py); else as chunks, piecewise where they fit.
        graphs = engine.verify_graph_runner
        uniform = uniform_verify_len(rows, bool(ctx))
        as_rows = self.link is None and graphs is not None and graphs.takes(len(rows), uniform)
        # Its rollback, where a graph of the verify graph's bucket runs it (rollback_graphs.py),
        # reads the saved rows from the held copies every step saves into.
        rb = self.rollback_graphs
        bucket = graphs.bucket(len(rows)) if as_rows and graphs is not None else None
        rollback_bucket = bucket if rb is not None and rb.takes(bucket) else None
        save = [_slot(v.request) for v in verify if v.drafts]
        snapshot = self.rollback.save(save)
        if as_rows:
            cb = build_verify_batch(engine.batch_builder, rows)
        else:
            cb = build_chunk_batch(engine.batch_builder, ctx, rows)
        batch = cb.batch
        for v, off in zip(verify, cb.offsets[len(ctx) :], strict=True):
            v.offset = off
        sampled = [r for r, (_, _, last) in zip(ctx, chunks, strict=True) if last]
        last_rows = [cb.offsets[i] + cb.lengths[i] - 1 for i, c in enumerate(chunks) if c[2]] + [
            v.offset + len(v.drafts) for v in verify
        ]
        sampled += [v.request for v in verify]
        # What the DeltaNet layers run the verify rows with, for a replay of the recurrence
        # alone (each tensor-parallel worker records its own: tp_spec.py), within the bound.
        held = self.rollback.record_bytes_per_token * batch.attn_metadata.num_tokens
        record = bool(save) and held <= RECORD_MAX_BYTES
        records: list[RowsRecord] | None = [] if record else None
        batch.attn_metadata.recurrent_record = records
        if self.link is not None:  # a worker's LM head gives its vocab columns of these rows
            self.link.send_target(batch, save, last_rows + check_rows(verify), record)
        # Piecewise graphs where the step fits: `hidden` is consumed (sampling, drafts) before
        # a replay forward below runs them again.
        hidden = engine.run_hidden(batch)
        step, packed = self._sample(executor, batch, hidden, sampled, last_rows, verify)
        if before_sync is not None:
            before_sync()
        tokens, logprobs, prompt, check = self._to_host(executor, step, packed, verify)
        release_prefilled_media(scheduled)
        advance_context_chunks(scheduled)
        apply_prompt_logprobs(prompt)
        self._apply(ctx, chunks, sampled, tokens, logprobs, verify, check)
        if guided is not None:
            guided.advance(sampled)
        if not self._graph_drafts(verify, uniform, hidden, cb.positions):
            self._draft_next(executor, ctx, chunks, cb.offsets, verify, hidden, cb.positions)
        self._forget_finished(executor)
        self._roll_back(verify, snapshot, records, len(ctx), rollback_bucket)

    def _sample(
        self,
        executor: PyExecutor,
        batch: InputBatch,
        hidden: torch.Tensor,
        sampled: list[LlmRequest],
        last_rows: list[int],
        verify: list[VerifyRow],
    ) -> tuple[SampledStep, torch.Tensor | None]:
        """The step's sampled tokens (with logprobs and prompt logprobs, one packed copy) and
        what the draft-checking rows say (`_checks`, on the device)."""
        model = self.engine.model
        dev = hidden.device
        checking = check_rows(verify)
        plan = batch.prompt_logprobs
        prompt = None
        if plan is not None:
            prompt = compute_prompt_logprobs(hidden, plan, model.lm_logits, self.engine.vocab_size)
        index = async_tensor_h2d(last_rows + checking, torch.int64, dev)
        logits = model.lm_logits(hidden.index_select(0, index))
        last, checks = logits[: len(last_rows)], logits[len(last_rows) :]
        packed = self._checks(checks[:, : self.engine.vocab_size], verify)
        guided = executor.guided_decoder
        if guided is not None and sampled:
            last = guided.mask_logits(last, sampled)
        if sampled:
            step = executor.sampler.sample_step(last, sampled)
        else:
            none = torch.empty(0, dtype=torch.int64, device=dev)
            step = SampledStep(none, none, None)
        if prompt is not None and plan is not None:
            step = attach(step, prompt, plan.layout)
        return step, packed

    def _checks(self, checks: torch.Tensor, verify: list[VerifyRow]) -> torch.Tensor | None:
        """Greedy tokens of every checking row, then for sampled requests' rows the rejection
        draws (acceptance, residual token), as one int64 device tensor (None: no row)."""
        if not checks.shape[0]:
            return None
        owners = [v.request for v in verify for _ in v.drafts]
        picked = [i for i, req in enumerate(owners) if not wants_drafts(req)]
        packed = checks.argmax(dim=-1)
        if picked:
            dev = checks.device
            rows = async_tensor_h2d(picked, torch.int64, dev)
            drafts = [d for v in verify for d in v.drafts]
            tokens = async_tensor_h2d([drafts[i] for i in picked], torch.int64, dev)
            accepted, residual = self.rejection.draws(
                checks.index_select(0, rows), tokens, [owners[i] for i in picked]
            )
            packed = torch.cat([packed, accepted.long(), residual])
        return packed

    def _to_host(
        self,
        executor: PyExecutor,
        step: SampledStep,
        packed: torch.Tensor | None,
        verify: list[VerifyRow],
    ) -> tuple[list[int], list | None, Any, DraftChecks]:
        """The step's results on the host: sampled tokens, logprobs, prompt logprobs and the
        checks. A step without logprobs takes one copy for tokens and checks together."""
        sampler = executor.sampler
        if packed is None:
            return (*sampler.step_results(step), DraftChecks())
        if step.layout is None and step.prompt is None:
            n = step.tokens.shape[0]
            host = sampler.to_host(torch.cat([step.tokens, packed]))
            return host[:n], None, None, unpack_checks(host[n:], verify)
        tokens, logprobs, prompt = sampler.step_results(step)
        return tokens, logprobs, prompt, unpack_checks(sampler.to_host(packed), verify)

    def _apply(
        self,
        ctx: list[LlmRequest],
        chunks: list[tuple[int, int, bool]],
        sampled: list[LlmRequest],
        tokens: list[int],
        logprobs: list | None,
        verify: list[VerifyRow],
        check: DraftChecks,
    ) -> None:
        """Plain rows take their sampled token; draft rows their accepted run."""
        num_ctx = len(sampled) - len(verify)
        plain = [i for i in range(len(sampled)) if i < num_ctx or not verify[i - num_ctx].drafts]
        apply_new_tokens(
            [sampled[i] for i in plain],
            [tokens[i] for i in plain],
            logprobs=None if logprobs is None else [logprobs[i] for i in plain],
        )
        at = 0
        for i, v in enumerate(verify):
            m = len(v.drafts)
            if not m:
                v.emitted = [tokens[num_ctx + i]]
                continue
            # The last row's token is the sampler's: the greedy argmax, or the bonus draw.
            bonus = tokens[num_ctx + i]
            if wants_drafts(v.request):
                target = [*check.greedy[at : at + m], bonus]
                a = num_accepted(v.drafts, target)
                run = target[: a + 1]
            else:
                accepted = [check.accepted[at + j] for j in range(m)]
                run = sampled_run(
                    v.drafts, accepted, [check.residual[at + j] for j in range(m)], bonus
                )
                a = len(run) - 1
            if self.accept_override is not None:  # trtllm-bench's bounds
                a = self.accept_override(m)
                rest = check.greedy if wants_drafts(v.request) else check.residual
                # The target's token after the a-th draft (the bonus after the last one).
                run = [*v.drafts[:a], bonus if a == m else rest[at + a]]
            at += m
            n = emit_accepted(v.request, run)
            v.emitted = run[:n]
            self.stats.num_verify_rows += 1
            self.stats.num_draft_tokens += m
            self.stats.num_accepted_tokens += a

    def _roll_back(
        self,
        verify: list[VerifyRow],
        snapshot: StateSnapshot | None,
        records: list[RowsRecord] | None,
        first_row: int,
        rollback_bucket: int | None = None,
    ) -> None:
        """Requests that rejected a draft: saved recurrent rows back, accepted tokens again
        (the recurrence alone where the verify step recorded it: a rollback graph of
        `rollback_bucket`, or eagerly; else a replay forward). `first_row`: the batch row of
        `verify[0]` (after the step's context chunks)."""
        replay = [
            (i, v)
            for i, v in enumerate(verify)
            if v.drafts and not v.request.is_finished and len(v.emitted) <= len(v.drafts)
        ]
        if not replay or snapshot is None:
            return
        slots = [_slot(v.request) for _, v in replay]
        self.stats.num_replays += len(replay)
        # Not finished: every accepted token was emitted, the bonus token last.
        if rollback_bucket is not None and self.rollback_graphs is not None:
            kept_slots = [(i, len(v.emitted), s) for (i, v), s in zip(replay, slots, strict=True)]
            self.rollback_graphs.replay(rollback_bucket, kept_slots)
            return
        kept = [(first_row + i, len(v.emitted)) for i, v in replay]
        layers = self.rollback.num_layers
        if records is not None and covers(records, [row for row, _ in kept], layers):
            if self.link is not None:
                self.link.send_replay_rows(slots, kept)
            self.rollback.replay_recorded(snapshot, records, kept, slots)
            return
        self.rollback.restore(snapshot, slots)
        rows = [
            ChunkRow(v.request, [v.token, *v.drafts[: len(v.emitted) - 1]], v.start)
            for _, v in replay
        ]
        batch = build_chunk_batch(self.engine.batch_builder, [], rows).batch
        if self.link is not None:
            self.link.send_replay(batch, slots)
        self.engine.run_hidden(batch)


def _refuse_prompt_logprobs(ctx: list[LlmRequest]) -> None:
    """Tensor parallelism: a worker does not run the prompt-logprob LM heads of a speculative
    step (their all-gathers), so such requests fail alone, before the step runs."""
    asking = [r.request_id for r in ctx if r.sampling_params.prompt_logprobs is not None]
    if asking:
        raise RequestInputError(
            asking,
            "prompt_logprobs with speculative_config and tensor_parallel_size > 1 is not "
            "supported yet",
        )


def _slot(req: LlmRequest) -> int:
    if req.seq_slot is None:
        raise RuntimeError(f"request {req.request_id} is scheduled without a seq slot")
    return req.seq_slot
