"""One step's Gated DeltaNet layout (context requests, then decodes) and the recurrent-state
rows a layer reads and writes: rows of a per-request tensor, or pool rows by seq slot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class GatedDeltaNetMetadata:
    """One step's layout, shared by every Gated DeltaNet layer (host data only).

    context_lens: new tokens of each context request this step, in packing order.
    has_initial_state: per context request, whether its state carries over from an earlier chunk.
    num_decodes: generation requests after the context requests, one token each.
    snapshots: `(context row, offset, scratch slot)` per context request whose recurrent state
        after its first `offset` new tokens (0 < offset < its length) is also wanted: the
        layer writes that state into the pool rows of `scratch slot` (prefix caching takes a
        snapshot inside a chunk without ending the chunk there; hybrid_kv_cache_reuse.py).
    """

    context_lens: tuple[int, ...] = ()
    has_initial_state: tuple[bool, ...] = ()
    num_decodes: int = 0
    snapshots: tuple[tuple[int, int, int], ...] = ()
    # Set by an MTP verify step (`AttentionMetadata.recurrent_record`): each layer's in-place
    # rows path appends what it ran (`gated_delta_net_rows.RowsRecord`), so a rollback can
    # run the rows again shorter without the rest of the model.
    record: list[Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.context_lens) != len(self.has_initial_state):
            raise ValueError(
                f"has_initial_state has {len(self.has_initial_state)} entries for "
                f"{len(self.context_lens)} context requests"
            )
        if any(n <= 0 for n in self.context_lens):
            raise ValueError(f"context_lens must be positive, got {list(self.context_lens)}")
        if self.num_decodes < 0:
            raise ValueError(f"num_decodes must be >= 0, got {self.num_decodes}")
        rows = [row for row, _, _ in self.snapshots]
        if len(set(rows)) != len(rows) or any(
            not 0 <= row < self.num_contexts or not 0 < off < self.context_lens[row]
            for row, off, _ in self.snapshots
        ):
            raise ValueError(
                f"snapshots {list(self.snapshots)} must name distinct context rows and offsets "
                f"strictly inside their chunks {list(self.context_lens)}"
            )

    @property
    def num_contexts(self) -> int:
        return len(self.context_lens)

    @property
    def num_context_tokens(self) -> int:
        return sum(self.context_lens)

    @property
    def num_seqs(self) -> int:
        return self.num_contexts + self.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.num_context_tokens + self.num_decodes

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Context token offsets, `num_contexts + 1` entries starting at 0."""
        offsets = [0]
        for n in self.context_lens:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)


@dataclass(frozen=True)
class StateRows:
    """The recurrent states of some of a step's requests: rows `lo:hi` of a per-request tensor
    (`slots` None), or the pool rows `slots[lo:hi]` (read by gather, written by index_copy)."""

    states: torch.Tensor
    slots: torch.Tensor | None
    lo: int = 0
    hi: int | None = None

    def rows(self, lo: int, hi: int) -> StateRows:
        return StateRows(self.states, self.slots, lo, hi)

    @property
    def device(self) -> torch.device:
        return self.states.device

    def read(self) -> torch.Tensor:
        if self.slots is None:
            return self.states[self.lo : self.hi]
        return self.states.index_select(0, self.slots[self.lo : self.hi])

    def write(self, final: torch.Tensor) -> None:
        if self.slots is None:
            self.states[self.lo : self.hi].copy_(final)
        else:
            self.states.index_copy_(0, self.slots[self.lo : self.hi], final.to(self.states.dtype))
