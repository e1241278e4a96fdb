"""MTP speculative steps under tensor parallelism: the worker ranks run every forward rank 0's
`SpecDecoder` runs, in the same order, so that the collectives of each one match.

A speculative step on rank 0 runs, besides its host work (sampling, acceptance):
1. the target forward over the context chunks and verify rows, then one LM head over the
   rows it samples or checks drafts with; the recurrent rows of the drafting requests are
   saved first (rollback.py);
2. the MTP passes (mtp_drafter.py): pass 1 over the step's positions, passes 2..k one token
   per drafting request, each with an embedding lookup, the head's layer and the LM head;
3. for requests that rejected a draft: their saved rows back, then the recurrence of their
   accepted tokens again from what each rank's verify forward recorded, or a replay forward.

Each part goes to the workers as a `SpecCommand` (the step channel's `send_spec`) and, for
the forwards, the part's batch as an ordinary step message (`send_step`): the target's (1)
with the slots to save and the rows the LM head runs over; the draft plan (2: rows, KV
positions, block tables, next tokens), then the greedy tokens of every pass, broadcast from
rank 0 (`share`), which the workers feed to their next pass instead of their own argmax, so
the ranks never diverge; the replay's (3) with the slots to restore (and, for the
recurrence alone, the rows and tokens kept instead of a batch). Everything on the wire
is token ids, positions and table rows: small, never model-size. A worker's LM head runs
over rank 0's rows (the all-gather hands rank 0 its vocab columns of them); its own logits
are dropped.

NOTE: the parts are self-contained: a step that fails on rank 0 between two of them (in the
sampling, say) leaves the worker between commands, in step with rank 0's next one. Inside a
part nothing raises on rank 0 that does not raise on the worker too (the same forwards).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ...input_batch import InputBatch
from ...modules.gated_delta_net_rows import RowsRecord, covers
from ..tp_step_channel import SpecCommand
from .mtp_drafter import DraftPlan, MTPDrafter
from .rollback import RecurrentRollback, StateSnapshot

if TYPE_CHECKING:
    from ...models.modeling_qwen3_next import Qwen3_5TextForCausalLM
    from ..model_engine import PyTorchModelEngine
    from ..tp_step_channel import StepChannel

SPEC_TARGET = 1  # [slots to save, record] + slots, LM-head rows; then the target batch
SPEC_DRAFT = 2  # [rows, block-table width] + DraftPlan.pack(); then one share per pass
SPEC_REPLAY = 3  # [slots to restore] + slots; then the replay batch
SPEC_REPLAY_ROWS = 4  # [rows] + slots, their batch rows, tokens kept: the recurrence alone

__all__ = ["SpecCommand", "SpecLink", "SpecWorker"]  # SpecCommand: the worker loop's type


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class SpecLink:
    """Rank 0's side: sends each part of a speculative step before rank 0 runs it."""

    def __init__(self, channel: StepChannel) -> None:
        self.channel = channel

    def send_target(
        self, batch: InputBatch, save_slots: list[int], logit_rows: list[int], record: bool
    ) -> None:
        """`record`: the DeltaNet rows are recorded for a replay of the recurrence alone."""
        payload = _ints(save_slots + logit_rows)
        self.channel.send_spec([SPEC_TARGET, len(save_slots), int(record)], payload)
        self.channel.send_step(batch)

    def send_draft(self, plan: DraftPlan) -> None:
        width = plan.block_table.shape[1]
        self.channel.send_spec([SPEC_DRAFT, plan.num_rows, width], plan.pack())

    def share_tokens(self, token: torch.Tensor) -> torch.Tensor:
        """A pass's draft tokens to the workers (rank 0 keeps its own)."""
        return self.channel.share(token)

    def send_replay(self, batch: InputBatch, restore_slots: list[int]) -> None:
        self.channel.send_spec([SPEC_REPLAY, len(restore_slots)], _ints(restore_slots))
        self.channel.send_step(batch)

    def send_replay_rows(self, restore_slots: list[int], kept: list[tuple[int, int]]) -> None:
        """The rollback as the recurrence alone (`replay_rows`): each rank replays from what
        its own verify forward recorded."""
        rows = [row for row, _ in kept] + [n for _, n in kept]
        self.channel.send_spec([SPEC_REPLAY_ROWS, len(kept)], _ints(restore_slots + rows))


class SpecWorker:
    """A worker rank's side: runs each part rank 0 sends on this rank's shards."""

    def __init__(
        self, engine: PyTorchModelEngine, channel: StepChannel, lm: Qwen3_5TextForCausalLM
    ) -> None:
        self.engine = engine
        self.channel = channel
        self.lm = lm  # the engine model's text LM with its MTP head (setup.text_lm)
        self.rollback = RecurrentRollback(engine.model, engine.max_batch_size)
        self.drafter: MTPDrafter | None = None
        # Between the parts of one step: the target's hidden states and positions (the
        # draft plan indexes them) and the saved recurrent rows (the replay restores them).
        self.hidden: torch.Tensor | None = None
        self.position_ids: torch.Tensor | None = None
        self.snapshot: StateSnapshot | None = None
        # What this rank's DeltaNet rows ran in the step's verify forward (replay_rows).
        self.records: list[RowsRecord] | None = None

    @torch.inference_mode()
    def handle(self, command: SpecCommand) -> None:
        phase, *sizes = command.values
        payload = command.payload
        if phase == SPEC_TARGET:
            self._target(payload[: sizes[0]].tolist(), payload[sizes[0] :], bool(sizes[1]))
        elif phase == SPEC_DRAFT:
            self._draft(DraftPlan.unpack(payload, sizes[0], sizes[1]))
        elif phase == SPEC_REPLAY:
            self._replay(payload.tolist())
        elif phase == SPEC_REPLAY_ROWS:
            n = sizes[0]
            values = payload.tolist()
            kept = list(zip(values[n : 2 * n], values[2 * n :], strict=True))
            self._replay_rows(values[:n], kept)
        else:
            raise RuntimeError(f"unknown speculative-step part {phase} from rank 0")

    def _next_batch(self) -> InputBatch:
        """The batch rank 0 sent right after the part's header, over this rank's KV cache."""
        batch = self.channel.receive()
        if not isinstance(batch, InputBatch):
            raise RuntimeError(f"rank 0 sent {type(batch).__name__} where a step's batch belongs")
        if self.channel.snapshot_copies:
            # attach_spec_decoder refuses block reuse, the only source of snapshot copies.
            raise RuntimeError("a speculative step carried recurrent-snapshot copies")
        kv = self.engine.kv_cache_manager
        if kv is None:
            raise RuntimeError("rank 0 sent a speculative step before any KV cache")
        return replace(batch, attn_metadata=replace(batch.attn_metadata, kv_cache_manager=kv))

    def _target(self, save_slots: list[int], logit_rows: torch.Tensor, record: bool) -> None:
        batch = self._next_batch()
        model = self.engine.model
        self.snapshot = self.rollback.save(save_slots)
        # Recorded where rank 0 records (spec_decoder.py): rows verify drafts, within the bound.
        self.records = [] if record else None
        batch.attn_metadata.recurrent_record = self.records
        hidden = model.forward_hidden(batch)
        # NOTE: the same rows as rank 0's: the all-gather hands rank 0 this rank's vocab
        # columns of them (its own logits are dropped).
        model.lm_logits(hidden.index_select(0, logit_rows.to(hidden.device)))
        self.hidden, self.position_ids = hidden, batch.position_ids

    def _draft(self, plan: DraftPlan) -> None:
        if self.hidden is None or self.position_ids is None:
            raise RuntimeError("rank 0 sent a draft plan before the step's target forward")
        kv = self.engine.kv_cache_manager
        if kv is None:
            raise RuntimeError("rank 0 sent a draft plan before any KV cache")
        drafter = self.drafter
        if drafter is None or drafter.kv_cache_manager is not kv:
            engine = self.engine
            drafter = MTPDrafter(
                self.lm, kv, engine.tokens_per_block, engine.vocab_size, engine.device
            )
            self.drafter = drafter
        drafter.run(plan, self.hidden, self.position_ids, self.channel.share)

    def _replay(self, restore_slots: list[int]) -> None:
        batch = self._next_batch()
        if self.snapshot is None:
            raise RuntimeError("rank 0 sent a replay without saving recurrent rows first")
        self.rollback.restore(self.snapshot, restore_slots)
        self.snapshot = self.records = None
        self.engine.model.forward_hidden(batch)

    def _replay_rows(self, restore_slots: list[int], kept: list[tuple[int, int]]) -> None:
        if self.snapshot is None or self.records is None:
            raise RuntimeError("rank 0 sent a recurrence replay without a recorded verify step")
        rows = [row for row, _ in kept]
        if not covers(self.records, rows, self.rollback.num_layers):
            raise RuntimeError(
                f"rank 0 replays rows {rows} this rank's verify forward did not record"
            )
        self.rollback.replay_recorded(self.snapshot, self.records, kept, restore_slots)
        self.snapshot = self.records = None
