"""RecurrentSnapshotPool: copies of one seq slot's recurrent state (every DeltaNet layer's conv
and SSM rows) taken at block-aligned token positions, for prefix caching of hybrid models.

A KV hit alone cannot resume a Qwen3.5 / 3.6 request: its linear-attention layers also need the
conv and SSM state after the cached tokens. A snapshot is that state after the first `p` tokens
of some sequence, `p` a multiple of tokens_per_block, stored under the block key of block
`p / tpb - 1` (`block_hash`: the key chains every earlier token and media hash, so it names the
whole prefix and a snapshot never goes stale; it is only useless once that block is evicted).

Entries are preallocated device tensors, one row per entry (`capacity` of them, from a byte
bound), so taking or restoring a snapshot is a device-to-device copy queued on the current
stream: no allocation, no host sync. Stream order is what makes it safe: a snapshot copy is
queued right after the forward that wrote the state, a restore before the first forward of
the request that reads it, and an entry reused later is overwritten only after every copy
queued from it.

Each entry is in one of three states:
- free: no content;
- keyed: findable by its key, in LRU order (the least recently taken or restored is evicted
  first when a new snapshot needs an entry); `drop` (its block was evicted) frees it;
- pending: owned by one running request (its latest aligned decode state, whose block key is
  not known yet); never evicted; the request `commit`s it under a key or `release`s it. At
  most `max_pending` (half the pool) are pending at once: the rest stays for keyed ones.

Tensor parallelism: each rank's pool holds its own shard of the state, so every rank must
make the same copies. Only rank 0's pool decides (its bookkeeping above); with `copy_log`
set it also records each device copy as `(SNAPSHOT_SAVE | SNAPSHOT_RESTORE, entry, seq slot)`
in call order, the step channel sends them with the next step, and a worker's pool of the
same capacity replays them by entry index (`apply_copies`) before that step's forward: the
same stream order as on rank 0. Frees, drops and evictions move no data, so nothing of them
travels.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..._utils import foreach_copy_
from .block_hash import BlockKey

SNAPSHOT_SAVE = 0  # seq slot rows -> pool entry
SNAPSHOT_RESTORE = 1  # pool entry -> seq slot rows


@dataclass
class SnapshotStats:
    """Cumulative counters (tests, logs)."""

    taken: int = 0  # snapshots copied in (keyed or pending)
    restored: int = 0  # snapshots copied into a seq slot at admission
    evicted: int = 0  # keyed entries reclaimed for a new snapshot (LRU)
    dropped: int = 0  # keyed entries freed because their block left the KV cache
    skipped: int = 0  # snapshots not taken: every entry pending, or max_pending reached


def snapshot_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes one snapshot takes: one row of each per-slot tensor."""
    return sum(t[0].numel() * t.element_size() for t in state.values())


class RecurrentSnapshotPool:
    """Bounded pool of recurrent-state snapshots (module docstring).

    `state`: the per-slot tensors to snapshot, `[slot rows, ...]` each (the model's
    `recurrent.*` entries of `EngineModel.per_slot_state`); `max_bytes`: the bound;
    `max_entries`: a lower entry count (tensor parallelism: the least any rank fits).
    """

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        max_bytes: int,
        max_entries: int | None = None,
    ) -> None:
        if not state:
            raise ValueError("RecurrentSnapshotPool needs at least one per-slot state tensor")
        per_entry = snapshot_bytes(state)
        capacity = max_bytes // per_entry if per_entry else 0
        if max_entries is not None:
            capacity = min(capacity, max_entries)
        if capacity < 1:
            raise ValueError(
                f"recurrent_state_snapshot_mib={max_bytes / 2**20:.1f} holds no snapshot: one "
                f"snapshot of this model's recurrent state takes {per_entry / 2**20:.1f} MiB; "
                "raise it or turn enable_block_reuse off"
            )
        self.capacity = capacity
        self.max_pending = capacity // 2
        self.bytes_per_snapshot = per_entry
        self._slots = list(state.values())
        # NOTE: empty, not zeros: an entry is only ever read after a copy into it.
        self._store = [
            torch.empty((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
            for t in self._slots
        ]
        self.stats = SnapshotStats()
        self._free = list(range(capacity - 1, -1, -1))
        self._entry_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # keyed entries, oldest first
        self._pending: dict[int, int] = {}  # request id -> its pending entry
        # Rank 0 of a tensor-parallel engine: the copies not sent yet (module docstring).
        self.copy_log: list[tuple[int, int, int]] | None = None

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_keyed(self) -> int:
        return len(self._entry_of)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_snapshot

    def has(self, key: BlockKey) -> bool:
        return key in self._entry_of

    # ---- copies ------------------------------------------------------------------------------
    def _copy_in(self, entry: int, seq_slot: int) -> None:
        foreach_copy_([s[entry] for s in self._store], [t[seq_slot] for t in self._slots])
        if self.copy_log is not None:
            self.copy_log.append((SNAPSHOT_SAVE, entry, seq_slot))

    def _copy_out(self, entry: int, seq_slot: int) -> None:
        foreach_copy_([t[seq_slot] for t in self._slots], [s[entry] for s in self._store])
        if self.copy_log is not None:
            self.copy_log.append((SNAPSHOT_RESTORE, entry, seq_slot))

    def take_copies(self) -> list[tuple[int, int, int]]:
        """Rank 0: the copies made since the last call (for the next step's message)."""
        if not self.copy_log:
            return []
        copies, self.copy_log = self.copy_log, []
        return copies

    def apply_copies(self, copies: list[tuple[int, int, int]]) -> None:
        """A worker rank: make rank 0's copies, by entry index, on this rank's shard (the
        worker's own bookkeeping stays empty: rank 0's decides every entry)."""
        for kind, entry, seq_slot in copies:
            if not 0 <= entry < self.capacity:
                raise RuntimeError(f"snapshot entry {entry} outside a pool of {self.capacity}")
            if kind == SNAPSHOT_SAVE:
                self._copy_in(entry, seq_slot)
                self.stats.taken += 1
            elif kind == SNAPSHOT_RESTORE:
                self._copy_out(entry, seq_slot)
                self.stats.restored += 1
            else:
                raise RuntimeError(f"unknown snapshot copy kind {kind}")

    def restore(self, key: BlockKey, seq_slot: int) -> None:
        """Copy the snapshot under `key` into `seq_slot`'s rows (KeyError when there is none)."""
        entry = self._entry_of[key]
        self._copy_out(entry, seq_slot)
        self._lru.move_to_end(entry)
        self.stats.restored += 1

    def _take_entry(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        entry, _ = self._lru.popitem(last=False)
        del self._entry_of[self._key_of.pop(entry)]
        self.stats.evicted += 1
        return entry

    def save(self, key: BlockKey, seq_slot: int) -> bool:
        """Snapshot `seq_slot`'s rows under `key` (a key already held keeps its entry: the
        state a key names is always the same). False when every entry is pending."""
        if key in self._entry_of:
            self._lru.move_to_end(self._entry_of[key])
            return True
        entry = self._take_entry()
        if entry is None:
            self.stats.skipped += 1
            return False
        self._copy_in(entry, seq_slot)
        self._set_key(entry, key)
        self.stats.taken += 1
        return True

    def save_pending(self, request_id: int, seq_slot: int) -> bool:
        """Snapshot `seq_slot`'s rows as the request's pending entry (overwriting its previous
        one). False when no entry could be had (the request then has none): `max_pending`
        reached or every entry pending."""
        entry = self._pending.get(request_id)
        if entry is None:
            if len(self._pending) >= self.max_pending:
                self.stats.skipped += 1
                return False
            entry = self._take_entry()
            if entry is None:
                self.stats.skipped += 1
                return False
            self._pending[request_id] = entry
        self._copy_in(entry, seq_slot)
        self.stats.taken += 1
        return True

    def has_pending(self, request_id: int) -> bool:
        return request_id in self._pending

    def commit(self, request_id: int, key: BlockKey) -> bool:
        """Key the request's pending entry (its content is the state `key` names). A key already
        held keeps its entry and the pending one is freed. False when there was none."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return False
        if key in self._entry_of:
            self._free.append(entry)
            self._lru.move_to_end(self._entry_of[key])
        else:
            self._set_key(entry, key)
        return True

    def release(self, request_id: int) -> None:
        """Free the request's pending entry, if any (preempted, failed, finished)."""
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            self._free.append(entry)

    def _set_key(self, entry: int, key: BlockKey) -> None:
        self._entry_of[key] = entry
        self._key_of[entry] = key
        self._lru[entry] = None

    # ---- eviction ----------------------------------------------------------------------------
    def drop(self, key: BlockKey) -> None:
        """Free the snapshot under `key` (its block left the KV cache); no-op without one."""
        entry = self._entry_of.pop(key, None)
        if entry is None:
            return
        del self._key_of[entry]
        del self._lru[entry]
        self._free.append(entry)
        self.stats.dropped += 1

    def demote(self, key: BlockKey) -> None:
        """Make the snapshot under `key` the next to evict (a later one of the same chain
        supersedes it); no-op without one."""
        entry = self._entry_of.get(key)
        if entry is not None:
            self._lru.move_to_end(entry, last=False)

    def clear(self) -> None:
        """Forget every keyed snapshot (pending ones stay with their requests)."""
        for key in list(self._entry_of):
            self.drop(key)

    def check_invariants(self) -> None:
        """Raise AssertionError unless every entry is in exactly one state."""
        free, keyed, pending = set(self._free), set(self._lru), set(self._pending.values())
        if len(free) != len(self._free) or len(pending) != len(self._pending):
            raise AssertionError("an entry is listed twice")
        if free & keyed or free & pending or keyed & pending:
            raise AssertionError("an entry is in two states")
        if len(free) + len(keyed) + len(pending) != self.capacity:
            raise AssertionError("an entry is in no state")
        if (
            set(self._key_of) != keyed
            or {self._entry_of[k] for k in self._key_of.values()} != keyed
        ):
            raise AssertionError("the key maps disagree with the LRU")
