"""SeqSlotManager and KVCacheManager: slot reuse, exact block accounting, step tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager


def _kv(num_blocks: int = 8, tpb: int = 4, max_blocks: int = 6, layers: int = 2) -> KVCacheManager:
    return KVCacheManager(
        num_layers=layers,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=tpb,
        num_blocks=num_blocks,
        max_blocks_per_seq=max_blocks,
        dtype=torch.float32,
        device="cpu",
    )


# ---- seq slots ---------------------------------------------------------------------------------
def test_seq_slots_lowest_free_and_idempotent() -> None:
    mgr = SeqSlotManager(4)
    assert [mgr.acquire(r) for r in (10, 11, 12)] == [0, 1, 2]
    assert mgr.acquire(11) == 1 and mgr.num_free == 1
    mgr.release(11)
    mgr.release(10)
    assert mgr.acquire(20) == 0  # the lowest freed slot, not the most recent
    assert mgr.acquire(21) == 1
    assert mgr.acquire(22) == 3
    with pytest.raises(RuntimeError, match="no free seq slot"):
        mgr.acquire(23)
    mgr.release(999)  # unknown: ignored
    assert mgr.num_free == 0 and mgr.get_slot(21) == 1
    mgr.reset()
    assert mgr.num_free == 4 and mgr.get_slot(21) is None


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=60))
def test_seq_slots_random_ops_stay_consistent(ops: list[tuple[bool, int]]) -> None:
    mgr = SeqSlotManager(5)
    held: dict[int, int] = {}
    for is_acquire, rid in ops:
        if is_acquire:
            if rid not in held and len(held) == 5:
                with pytest.raises(RuntimeError):
                    mgr.acquire(rid)
                continue
            free = sorted(set(range(5)) - set(held.values()))
            slot = mgr.acquire(rid)
            assert slot == held.get(rid, free[0] if free else -1)
            held[rid] = slot
        else:
            mgr.release(rid)
            held.pop(rid, None)
        assert mgr.num_free == 5 - len(held)
        assert len(set(held.values())) == len(held)


# ---- KV blocks ---------------------------------------------------------------------------------
def test_kv_buffers_shape_and_bytes_per_block() -> None:
    kv = _kv()
    buf = kv.get_buffers(1)
    assert buf.shape == (8, 2, 4, 2, 8) and buf.dtype == torch.float32
    assert kv.get_buffers(0).data_ptr() != buf.data_ptr()
    assert KVCacheManager.bytes_per_block(2, 2, 8, 4, torch.float32) == buf[0].numel() * 4 * 2
    assert KVCacheManager.bytes_per_block(3, 4, 64, 32, torch.bfloat16) == 3 * 2 * 32 * 4 * 64 * 2


def test_kv_add_tokens_grows_and_all_or_nothing() -> None:
    kv = _kv(num_blocks=5, tpb=4, max_blocks=6)
    assert kv.add_tokens(1, 5)  # 2 blocks
    assert kv.get_block_ids(1) == [0, 1] and kv.get_num_tokens(1) == 5
    assert kv.add_tokens(1, 3)  # 8 tokens: still 2 blocks
    assert kv.num_used_blocks == 2
    assert kv.add_tokens(1, 1)  # 9 tokens: 3 blocks
    assert kv.num_free_blocks == 2 and kv.usage == pytest.approx(3 / 5)
    assert not kv.can_fit(2, 12) and not kv.add_tokens(2, 12)  # needs 3, 2 free
    assert kv.num_free_blocks == 2 and kv.get_block_ids(2) == [] and not kv.has_request(2)
    assert kv.can_fit(2, 8) and kv.add_tokens(2, 8)
    kv.free(1)
    assert kv.num_free_blocks == 3 and kv.get_block_ids(1) == []
    assert kv.add_tokens(3, 1) and kv.get_block_ids(3) == [0]  # freed lowest block reused first


def test_kv_per_sequence_cap() -> None:
    kv = _kv(num_blocks=20, tpb=4, max_blocks=2)
    assert not kv.can_fit(1, 9)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        kv.add_tokens(1, 9)
    assert kv.num_free_blocks == 20


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "free"]), st.integers(0, 5), st.integers(0, 13)),
        max_size=50,
    )
)
def test_kv_block_accounting_is_exact(ops: list[tuple[str, int, int]]) -> None:
    tpb, num_blocks, max_blocks = 4, 12, 5
    kv = _kv(num_blocks=num_blocks, tpb=tpb, max_blocks=max_blocks)
    tokens: dict[int, int] = {}
    for op, rid, n in ops:
        if op == "free":
            kv.free(rid)
            tokens.pop(rid, None)
        else:
            total = tokens.get(rid, 0) + n
            need = -(-total // tpb) - len(kv.get_block_ids(rid))
            if -(-total // tpb) > max_blocks:
                with pytest.raises(ValueError):
                    kv.add_tokens(rid, n)
            elif need > kv.num_free_blocks:
                before = kv.num_free_blocks
                assert not kv.add_tokens(rid, n)
                assert kv.num_free_blocks == before
            else:
                assert kv.add_tokens(rid, n)
                tokens[rid] = total
        owned = [b for rid in tokens for b in kv.get_block_ids(rid)]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert all(0 <= b < num_blocks for b in owned)
        assert kv.num_free_blocks + len(owned) == num_blocks
        assert kv.num_used_blocks == len(owned)
        for rid, total in tokens.items():
            assert len(kv.get_block_ids(rid)) == -(-total // tpb)


def test_block_table_and_slot_mapping() -> None:
    kv = _kv(num_blocks=8, tpb=4, max_blocks=4)
    kv.add_tokens(7, 4)  # block 0
    kv.add_tokens(8, 6)  # blocks 1, 2
    kv.add_tokens(7, 2)  # block 3
    table = kv.get_block_table([8, 7, 99], max_blocks=3)
    assert table.dtype == torch.int32 and table.device.type == "cpu"
    assert table.tolist() == [[1, 2, -1], [0, 3, -1], [-1, -1, -1]]
    out = torch.full((5, 4), -7, dtype=torch.int32)
    view = kv.get_block_table([7], out=out)
    assert view.tolist() == [[0, 3, -1, -1]] and out[1].tolist() == [-7] * 4
    with pytest.raises(ValueError, match="max_blocks"):
        kv.get_block_table([8], max_blocks=1)

    assert kv.slot_mapping_for(7, 2, 6) == [2, 3, 12, 13]
    assert kv.slot_mapping_for(8, 5, 6) == [9]
    packed = kv.build_slot_mapping([7, 8, 8], [2, 0, 5], [6, 3, 6])
    assert packed.dtype == torch.int64
    assert packed.tolist() == [2, 3, 12, 13, 4, 5, 6, 9]
    assert kv.build_slot_mapping([], [], []).numel() == 0
    with pytest.raises(ValueError, match="outside"):
        kv.slot_mapping_for(8, 0, 9)  # 2 blocks hold 8 tokens
