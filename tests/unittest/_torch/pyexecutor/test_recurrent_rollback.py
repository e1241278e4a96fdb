"""`RecurrentRollback`'s saved rows: row-by-row multi-tensor copies for a few slots, a gather
per pool for many; both give the slots' rows as they were, and `restore` puts them back."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.spec_decode import rollback as rollback_module
from tensorrt_llm._torch.pyexecutor.spec_decode.rollback import RecurrentRollback


class _Model:
    """The per-slot state a hybrid model exposes: 16-bit conv rows, float32 SSM rows."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.state = {}
        for j in range(3):
            conv = torch.randn(7, 12, 3, generator=gen).bfloat16()
            ssm = torch.randn(7, 2, 4, 5, generator=gen)
            self.state[f"recurrent.conv_{j}"], self.state[f"recurrent.ssm_{j}"] = conv, ssm

    def per_slot_state(self) -> dict[str, torch.Tensor]:
        return self.state


@pytest.mark.parametrize("by_row", [True, False])
def test_save_copies_the_rows_and_restore_puts_them_back(
    by_row: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollback_module, "SAVE_BY_ROW_MAX_SLOTS", 16 if by_row else 0)
    model = _Model()
    rollback = RecurrentRollback(model)  # type: ignore[arg-type]
    before = {n: t.clone() for n, t in model.state.items()}
    snapshot = rollback.save([5, 1, 3])
    assert snapshot is not None and snapshot.slots == [5, 1, 3]
    for pool, rows in zip(rollback.pools, snapshot.rows, strict=True):
        assert rows.dtype == pool.dtype and torch.equal(rows, pool[[5, 1, 3]])
    for t in model.state.values():
        t.add_(1)  # the verify step writes the rows
    rollback.restore(snapshot, [3, 5])
    for name, t in model.state.items():
        assert torch.equal(t[[3, 5]], before[name][[3, 5]])
        assert torch.equal(t[1], (before[name][1].float() + 1).to(t.dtype))  # not restored
    assert rollback.save([]) is None


@pytest.mark.parametrize("by_row", [True, False])
def test_save_into_given_copies(by_row: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`save(slots, into=)` (the rollback graphs' static copies): the first rows of the
    given tensors hold the slots' rows, and the snapshot's rows are views of them."""
    monkeypatch.setattr(rollback_module, "SAVE_BY_ROW_MAX_SLOTS", 16 if by_row else 0)
    model = _Model()
    rollback = RecurrentRollback(model)  # type: ignore[arg-type]
    into = [p.new_zeros((4, *p.shape[1:])) for p in rollback.pools]
    snapshot = rollback.save([6, 2], into=into)
    assert snapshot is not None
    for pool, rows, out in zip(rollback.pools, snapshot.rows, into, strict=True):
        assert rows.data_ptr() == out.data_ptr() and torch.equal(out[:2], pool[[6, 2]])
        assert not out[2:].any()
    with pytest.raises(ValueError, match="do not fit"):
        rollback.save([0, 1, 2, 3, 4], into=into)


@pytest.mark.parametrize("by_row", [True, False])
def test_saves_reuse_the_held_rows(by_row: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `num_rows` (the engine's rollback) every save writes the same held copies, one
    row a slot up to the seq slots (the pools' last row is the dummy), and a later save of
    the same slots copies the rows as they are then (the cached row views are views)."""
    monkeypatch.setattr(rollback_module, "SAVE_BY_ROW_MAX_SLOTS", 16 if by_row else 0)
    model = _Model()
    rollback = RecurrentRollback(model, num_rows=64)  # type: ignore[arg-type]
    assert rollback.saved_rows is not None
    assert [r.shape[0] for r in rollback.saved_rows] == [6] * len(rollback.pools)
    held = [r.data_ptr() for r in rollback.saved_rows]
    for step in range(3):
        for t in model.state.values():
            t.add_(1)  # each verify step writes the rows
        slots = [4, 0, 2][: step + 1]
        snapshot = rollback.save(slots)
        assert snapshot is not None
        for pool, rows, ptr in zip(rollback.pools, snapshot.rows, held, strict=True):
            assert rows.data_ptr() == ptr and torch.equal(rows, pool[slots])
    with pytest.raises(ValueError, match="do not fit"):
        rollback.save(list(range(7)))


def test_the_conv_rollback_kernel_is_compiled_on_the_dummy_slot_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the Triton path runs (CUDA; forced here under the interpreter), building the
    rollback launches the conv kernel once per pool shape, writing the dummy slot alone."""
    launches: list[int] = []
    real = rollback_module.causal_conv1d_rollback_

    def spy(pool: torch.Tensor, slots: torch.Tensor, *args: torch.Tensor) -> None:
        launches.append(int(slots[0]))
        real(pool, slots, *args, backend="triton")

    monkeypatch.setattr(rollback_module, "use_triton", lambda *args: True)
    monkeypatch.setattr(rollback_module, "causal_conv1d_rollback_", spy)
    model = _Model()
    before = {n: t.clone() for n, t in model.state.items()}
    RecurrentRollback(model)  # type: ignore[arg-type]
    assert launches == [6]  # three conv pools of one shape: one launch, on the last row
    for name, t in model.state.items():
        assert torch.equal(t[:6], before[name][:6])
