"""Recurrent-state rollback of the Gated DeltaNet and causal-conv layers for rejected drafts.

A verify row runs 1 + m tokens through the recurrent layers, which leave the state after the
last of them; a request that accepts a < m drafts needs the state after 1 + a tokens. The
choice here is save-and-replay: the rows of the step's draft requests are copied aside
before the verify forward (one gather per per-slot tensor), and a request that rejected a
draft gets them back and re-runs its 1 + a accepted tokens in a replay forward (a chunk of
the same positions: its KV writes repeat the verify's). Full acceptance costs the copy only.

The replay runs the recurrence only where it can: a verify step records what each DeltaNet
layer's in-place rows path ran (`AttentionMetadata.recurrent_record`), and a rejected row's
accepted tokens go through just the conv gather and the rows kernel again, starting from the
saved copies themselves (`replay_recorded` -> `gated_delta_net_rows.replay_rows`: two launches
a layer, no restore), not the whole model; under tensor parallelism every rank replays from
its own record (tp_spec.py). Where a row was not recorded (a step whose rows took the
chunked rule), the rows are restored and the replay forward runs.

NOTE: the other alternative, keeping the state after every position and selecting the
accepted one, costs a state per position and layer (147 MiB a token for Qwen3.6-27B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...._utils import async_tensor_h2d, foreach_copy_
from ...modules.gated_delta_net_rows import RowsRecord, replay_rows
from ...modules.triton_kernels import use_triton
from ...modules.triton_kernels.conv_rollback import causal_conv1d_rollback_

if TYPE_CHECKING:
    from ...models.engine_model import EngineModel

RECURRENT_PREFIX = "recurrent."
# Up to this many rows a save copies row by row (two multi-tensor copies a row: the conv and
# the SSM dtypes), past it one gather per pool (two per DeltaNet layer) is fewer launches.
SAVE_BY_ROW_MAX_SLOTS = 16


@dataclass
class StateSnapshot:
    """Copies of the per-slot recurrent rows of `slots` (host ints, in snapshot order)."""

    slots: list[int]
    rows: list[torch.Tensor]  # one [len(slots), ...] copy per recurrent pool


class RecurrentRollback:
    def __init__(self, model: EngineModel, num_rows: int | None = None) -> None:
        state = model.per_slot_state()
        self.pools = [t for name, t in state.items() if name.startswith(RECURRENT_PREFIX)]
        # One SSM pool per DeltaNet layer (modeling_qwen3_next.RecurrentStateCache's names).
        self.num_layers = sum(name.startswith(f"{RECURRENT_PREFIX}ssm_") for name in state)
        self.record_bytes_per_token = record_bytes_per_token(state)
        if not self.pools:
            raise ValueError(
                f"{type(model).__name__} keeps no recurrent state ({RECURRENT_PREFIX}*): MTP "
                "speculation here is built for the Qwen3.5 / Qwen3.6 hybrid stacks"
            )
        self._compile_conv_rollback(state)
        # The saved rows of a full batch of `num_rows` requests (at most one a seq slot; the
        # pools' last row is the dummy slot), held for good (None: each save allocates its
        # own): the memory setup.snapshot_reserve_bytes keeps out of the KV cache, and the
        # static copies the rollback graphs read (rollback_graphs.py). Zeros: a padded
        # request of a rollback graph replays from its row.
        self.saved_rows: list[torch.Tensor] | None = None
        if num_rows is not None:
            rows = min(num_rows, self.pools[0].shape[0] - 1)
            self.saved_rows = [p.new_zeros((rows, *p.shape[1:])) for p in self.pools]
        # Row views of the pools (by slot) and of `saved_rows` (by row), made once and grouped
        # by dtype (one fused multi-tensor copy each): a save of a few rows is otherwise ~200
        # tensor views and the grouping a row of host time (Qwen3.6-27B).
        self._dtype_groups = _dtype_groups(self.pools)
        self._slot_views: dict[int, list[list[torch.Tensor]]] = {}
        self._saved_views: dict[int, list[list[torch.Tensor]]] = {}
        self._prefixes: dict[int, list[torch.Tensor]] = {}  # the first n held rows, by n

    def _compile_conv_rollback(self, state: dict[str, torch.Tensor]) -> None:
        """Launch the conv-state rollback kernel once per pool shape on the dummy slot (its
        state is never read), so the first rejected draft compiles nothing mid-serving. The
        replay's recurrence runs the verify rows' own compiled kernel."""
        done = set()
        for name, pool in state.items():
            key = (pool.dtype, tuple(pool.shape[1:]))
            if not name.startswith(f"{RECURRENT_PREFIX}conv_") or key in done:
                continue
            done.add(key)
            if not use_triton("causal_conv1d_rollback_", pool.device, "auto"):
                continue
            dummy = pool.shape[0] - 1  # seq_slots.py: the last row
            width = pool.shape[-1] + 1
            index = torch.full((1,), dummy, dtype=torch.int64, device=pool.device)
            zero, one = torch.zeros_like(index), torch.ones_like(index)
            x = pool.new_zeros(width, pool.shape[1])
            causal_conv1d_rollback_(pool, index, pool[dummy:].clone(), zero, x, zero, one)

    def save(
        self, slots: list[int], into: list[torch.Tensor] | None = None
    ) -> StateSnapshot | None:
        """Copy the rows of `slots` (None when there are none) into the first rows of `into`
        (one tensor per pool), else of `saved_rows`, else into new tensors."""
        if not slots:
            return None
        n = len(slots)
        held = into is None and self.saved_rows is not None
        if into is None:
            into = self.saved_rows
        if into is not None and (len(into) != len(self.pools) or into[0].shape[0] < n):
            raise ValueError(f"{n} saved rows do not fit the given copies")
        if n > SAVE_BY_ROW_MAX_SLOTS:  # one gather a pool
            index = async_tensor_h2d(slots, torch.int64, self.pools[0].device)
            if into is None:
                return StateSnapshot(list(slots), [p.index_select(0, index) for p in self.pools])
            rows = self._held_prefix(n) if held else [out[:n] for out in into]
            for p, out in zip(self.pools, rows, strict=True):
                torch.index_select(p, 0, index, out=out)
            return StateSnapshot(list(slots), rows)
        # A few rows: one multi-tensor copy per row and dtype instead of a gather per pool
        # (~100 launches for Qwen3.6's 48 DeltaNet layers).
        if into is None:
            rows = [p.new_empty((n, *p.shape[1:])) for p in self.pools]
        elif held:
            rows = self._held_prefix(n)
        else:
            rows = [out[:n] for out in into]
        for i, slot in enumerate(slots):
            if not held:
                foreach_copy_([r[i] for r in rows], [p[slot] for p in self.pools])
                continue
            assert self.saved_rows is not None
            src = self._views(self._slot_views, self.pools, slot)
            dst = self._views(self._saved_views, self.saved_rows, i)
            for group_dst, group_src in zip(dst, src, strict=True):
                torch._foreach_copy_(group_dst, group_src)
        return StateSnapshot(list(slots), rows)

    def _held_prefix(self, n: int) -> list[torch.Tensor]:
        rows = self._prefixes.get(n)
        if rows is None:
            assert self.saved_rows is not None
            rows = self._prefixes[n] = [r[:n] for r in self.saved_rows]
        return rows

    def _views(
        self, cache: dict[int, list[list[torch.Tensor]]], tensors: list[torch.Tensor], row: int
    ) -> list[list[torch.Tensor]]:
        """Row `row` of each of `tensors` (the pools or the held rows), by dtype group."""
        views = cache.get(row)
        if views is None:
            views = cache[row] = [[tensors[j][row] for j in group] for group in self._dtype_groups]
        return views

    def replay_recorded(
        self,
        snapshot: StateSnapshot,
        records: list[RowsRecord],
        kept: list[tuple[int, int]],
        slots: list[int],
    ) -> None:
        """The recurrence of each `(batch row, tokens kept)` of `kept` again, in every recorded
        layer, from the saved rows of `slots` (a subset of the snapshot's): the pool rows end
        as after the kept tokens, without a restore first."""
        where = {slot: i for i, slot in enumerate(snapshot.slots)}
        pairs = zip(self.pools, snapshot.rows, strict=True)
        saved = {pool.data_ptr(): rows for pool, rows in pairs}
        replay_rows(records, kept, slots, saved, [where[s] for s in slots])

    def restore(self, snapshot: StateSnapshot, slots: list[int]) -> None:
        """Write back the saved rows of `slots` (a subset of the snapshot's)."""
        if not slots:
            return
        where = {slot: i for i, slot in enumerate(snapshot.slots)}
        dev = self.pools[0].device
        picked = async_tensor_h2d([where[s] for s in slots], torch.int64, dev)
        index = async_tensor_h2d(slots, torch.int64, dev)
        for pool, rows in zip(self.pools, snapshot.rows, strict=True):
            pool.index_copy_(0, index, rows.index_select(0, picked))


def _dtype_groups(pools: list[torch.Tensor]) -> list[list[int]]:
    """The pools' indices by dtype (CUDA's fused multi-tensor copy takes one dtype a list)."""
    groups: dict[torch.dtype, list[int]] = {}
    for j, pool in enumerate(pools):
        groups.setdefault(pool.dtype, []).append(j)
    return list(groups.values())


def record_bytes_per_token(state: dict[str, torch.Tensor]) -> int:
    """What a verify step's record (`gated_delta_net_rows.RowsRecord`) holds a token, over
    the DeltaNet layers, read off their pools: the input projections' output (conv inputs
    `conv_dim`, output gate `Hv * V`, raw gates `2 * Hv`) and the conv output (`conv_dim`),
    in the conv pool's dtype (the model's)."""
    total = 0
    for name, conv in state.items():
        if not name.startswith(f"{RECURRENT_PREFIX}conv_"):
            continue
        ssm = state[name.replace("conv_", "ssm_", 1)]
        heads, head_v = ssm.shape[1], ssm.shape[3]
        width = 2 * conv.shape[1] + heads * head_v + 2 * heads
        total += width * conv.element_size()
    return total
