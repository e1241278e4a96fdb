"""RecurrentSnapshotPool: the byte bound, exact copies in and out, LRU, pending entries, and
snapshots dropped with their KV blocks (through `BlockPool.on_evict`)."""

from __future__ import annotations

import random

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.block_hash import compute_block_keys
from tensorrt_llm._torch.pyexecutor.block_pool import BlockPool
from tensorrt_llm._torch.pyexecutor.state_snapshot_pool import (
    SNAPSHOT_RESTORE,
    SNAPSHOT_SAVE,
    RecurrentSnapshotPool,
    snapshot_bytes,
)

TPB = 4
SLOTS = 3  # slot rows (seq slots + the dummy one)


def _state(device: str = "cpu") -> dict[str, torch.Tensor]:
    """Per-slot tensors shaped like one DeltaNet layer's conv (16-bit) and SSM (fp32) rows."""
    gen = torch.Generator().manual_seed(0)
    return {
        "recurrent.conv_0": torch.randn(SLOTS, 8, 3, generator=gen).to(device, torch.bfloat16),
        "recurrent.ssm_0": torch.randn(SLOTS, 2, 4, 4, generator=gen).to(device),
    }


def _keys(n: int, salt: str = "") -> list[bytes]:
    return compute_block_keys(list(range(n * TPB)), TPB, cache_salt=salt or None)


def _pool(state: dict[str, torch.Tensor], entries: int) -> RecurrentSnapshotPool:
    return RecurrentSnapshotPool(state, entries * snapshot_bytes(state) + 1)


def test_bound_in_bytes_and_too_small_is_an_error() -> None:
    state = _state()
    per = snapshot_bytes(state)
    assert per == 8 * 3 * 2 + 2 * 4 * 4 * 4
    pool = RecurrentSnapshotPool(state, 5 * per + per - 1)
    assert pool.capacity == 5 and pool.nbytes == 5 * per <= 6 * per - 1
    with pytest.raises(ValueError, match="recurrent_state_snapshot_mib.*holds no snapshot"):
        RecurrentSnapshotPool(state, per - 1)
    with pytest.raises(ValueError, match="at least one per-slot state tensor"):
        RecurrentSnapshotPool({}, 2**20)


def _roundtrip(device: str) -> None:
    state = _state(device)
    pool = _pool(state, 2)
    key = _keys(1)[0]
    want = {n: t[1].clone() for n, t in state.items()}
    assert pool.save(key, seq_slot=1)
    for t in state.values():
        t[1].zero_()  # the slot moves on (or is recycled): the snapshot must not follow it
    pool.restore(key, seq_slot=0)
    for name, t in state.items():
        assert torch.equal(t[0], want[name]), name
        assert t.dtype == want[name].dtype
    assert pool.stats.taken == pool.stats.restored == 1
    with pytest.raises(KeyError):
        pool.restore(_keys(2)[1], seq_slot=0)


def test_save_and_restore_are_exact_copies() -> None:
    _roundtrip("cpu")


@pytest.mark.gpu
def test_save_and_restore_are_exact_copies_on_cuda() -> None:
    _roundtrip("cuda")


def test_lru_eviction_and_restore_refreshes() -> None:
    state = _state()
    pool = _pool(state, 2)
    a, b, c = _keys(3)
    assert pool.save(a, 0) and pool.save(b, 0)
    pool.restore(a, 1)  # a is now the most recent: b goes first
    assert pool.save(c, 0)
    assert pool.has(a) and pool.has(c) and not pool.has(b)
    assert pool.stats.evicted == 1
    pool.demote(c)  # superseded: evicted before a
    assert pool.save(b, 0)
    assert pool.has(a) and pool.has(b) and not pool.has(c)
    # A key already held keeps its entry (its state is always the same).
    assert pool.save(a, 2) and pool.num_keyed == 2 and pool.stats.evicted == 2
    pool.check_invariants()


def test_pending_entries_are_never_evicted_and_take_half_the_pool() -> None:
    state = _state()
    pool = _pool(state, 4)
    assert pool.max_pending == 2
    a, b, c, d = _keys(4)
    assert pool.save_pending(request_id=7, seq_slot=0)
    assert pool.save_pending(request_id=7, seq_slot=1)  # overwrites its own entry
    assert pool.num_pending == 1
    assert pool.save(a, 0) and pool.save(b, 0) and pool.save(c, 0)
    assert pool.save_pending(request_id=8, seq_slot=0)  # evicts a, never 7's entry
    assert not pool.has(a) and pool.has(b)
    assert not pool.save_pending(9, 0)  # half the pool is pending: skipped
    assert pool.stats.skipped == 1
    assert pool.save(d, 0) and not pool.has(b)  # keyed entries evict keyed ones
    want = {n: t[1].clone() for n, t in state.items()}  # 7's last save was slot 1
    assert pool.commit(7, a) and pool.has(a) and not pool.has_pending(7)
    pool.restore(a, 2)
    assert all(torch.equal(t[2], want[n]) for n, t in state.items())
    pool.release(8)
    pool.release(8)  # a request without a pending entry is ignored
    assert not pool.commit(8, b)
    assert pool.num_pending == 0
    pool.check_invariants()


def test_commit_under_a_held_key_frees_the_pending_entry() -> None:
    pool = _pool(_state(), 2)
    (a,) = _keys(1)
    assert pool.save(a, 0) and pool.save_pending(1, 1)
    assert pool.commit(1, a)
    assert pool.num_keyed == 1 and pool.num_pending == 0
    assert pool.save(_keys(2, "x")[1], 0)  # the freed entry is usable without an eviction
    assert pool.stats.evicted == 0
    pool.check_invariants()


def test_snapshots_leave_with_their_blocks() -> None:
    """A BlockPool eviction drops the snapshot of the evicted block's key, and only that."""
    blocks = BlockPool(4)
    snaps = _pool(_state(), 8)
    blocks.on_evict = snaps.drop
    first, second = _keys(2), _keys(2, "other")
    for keys in (first, second):
        ids = blocks.allocate(2)
        assert ids is not None
        for block, key in zip(ids, keys, strict=True):
            blocks.register(block, key)
            assert snaps.save(key, 0)
        blocks.release(ids)
    assert blocks.allocate(2) is not None  # the oldest two evictable blocks: `first`'s
    assert not snaps.has(first[0]) and not snaps.has(first[1])
    assert snaps.has(second[0]) and snaps.has(second[1])
    assert snaps.stats.dropped == 2
    assert blocks.clear_cache() == 2
    assert snaps.num_keyed == 0
    snaps.drop(first[0])  # already gone: no-op
    snaps.check_invariants()


def test_a_block_pool_reset_drops_every_snapshot() -> None:
    blocks = BlockPool(4)
    snaps = _pool(_state(), 8)
    blocks.on_evict = snaps.drop
    ids = blocks.allocate(2)
    assert ids is not None
    for block, key in zip(ids, _keys(2), strict=True):
        blocks.register(block, key)
        assert snaps.save(key, 0)
    blocks.reset()
    assert snaps.num_keyed == 0 and blocks.num_cached_blocks == 0
    snaps.check_invariants()


def test_random_operations_keep_the_invariants() -> None:
    rng = random.Random(0)
    pool = _pool(_state(), 4)
    keys = _keys(12)
    for _ in range(500):
        op = rng.randrange(6)
        key = rng.choice(keys)
        rid = rng.randrange(4)
        if op == 0:
            pool.save(key, rng.randrange(SLOTS))
        elif op == 1:
            pool.save_pending(rid, rng.randrange(SLOTS))
        elif op == 2:
            pool.commit(rid, key)
        elif op == 3:
            pool.release(rid)
        elif op == 4:
            pool.drop(key)
        elif pool.has(key):
            pool.restore(key, rng.randrange(SLOTS))
        pool.check_invariants()
        assert pool.num_keyed + pool.num_pending <= pool.capacity


def test_a_replica_replays_the_copies_by_entry_index() -> None:
    """Tensor parallelism: rank 0's pool logs its copies; a pool of the same capacity over
    another rank's state (here: the same values) that replays them holds the same entries
    and restores the same rows, with no bookkeeping of its own."""
    lead_state, replica_state = _state(), _state()
    lead = _pool(lead_state, 3)
    replica = RecurrentSnapshotPool(replica_state, 10 * snapshot_bytes(replica_state), 3)
    assert replica.capacity == lead.capacity == 3
    lead.copy_log = []
    keys = _keys(4)
    for step, key in enumerate(keys):  # the 4th save evicts the 1st key's entry
        for rank_state in (lead_state, replica_state):
            for t in rank_state.values():
                t[0].fill_(step)
        lead.save(key, 0)
        replica.apply_copies(lead.take_copies())
    lead.restore(keys[2], 1)
    copies = lead.take_copies()
    assert copies == [(SNAPSHOT_RESTORE, 2, 1)] and lead.take_copies() == []
    replica.apply_copies(copies)
    for lead_t, replica_t in zip(lead_state.values(), replica_state.values(), strict=True):
        assert torch.equal(replica_t, lead_t) and bool((replica_t[1] == 2).all())
    assert replica.stats.taken == 4 and replica.stats.restored == 1 and replica.num_keyed == 0
    with pytest.raises(RuntimeError, match="outside a pool of 3"):
        replica.apply_copies([(SNAPSHOT_SAVE, 3, 0)])


def test_default_pool_bytes_grows_to_a_full_batch_of_chats_within_the_max_share() -> None:
    from tensorrt_llm._torch.pyexecutor import hybrid_kv_cache_reuse as hybrid

    mib, gib = 2**20, 2**30
    entry = 146 * mib  # about one Qwen3.6-27B snapshot
    # 80 GiB free: the share is 16 GiB (the cap) = 112 entries; 32 slots want 4 x 32 = 128.
    assert hybrid.default_pool_bytes(80 * gib, entry, 32) == 128 * entry
    # A small batch keeps the share (the pool never shrinks below it).
    assert hybrid.default_pool_bytes(80 * gib, entry, 4) == 16 * gib
    # 128 slots would want 73 GiB: held to 40% of the free memory.
    assert hybrid.default_pool_bytes(80 * gib, entry, 128) == int(80 * gib * 0.4)
    # The user's bound wins over the default.
    config = type("C", (), {"recurrent_state_snapshot_bytes": 3 * mib})()
    cpu = torch.device("cpu")
    assert hybrid.snapshot_pool_bytes(config, cpu, entry, 32) == 3 * mib  # type: ignore[arg-type]
