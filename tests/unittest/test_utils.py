"""Pinned-staging helpers and the grouped multi-tensor copy."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._utils import async_tensor_h2d, foreach_copy_, maybe_pin_memory, prefer_pinned


def test_pin_is_noop_without_cuda_or_for_device_tensors() -> None:
    t = torch.arange(4)
    out = maybe_pin_memory(t)
    if not prefer_pinned():
        assert out is t
    meta = torch.empty(3, device="meta")
    assert maybe_pin_memory(meta) is meta


def test_async_h2d_builds_requested_dtype() -> None:
    out = async_tensor_h2d([1, 2, 3], torch.int32, "cpu")
    assert out.dtype == torch.int32 and out.tolist() == [1, 2, 3]
    out = async_tensor_h2d(torch.tensor([1.5, 2.5]), torch.float64, "cpu")
    assert out.dtype == torch.float64 and out.tolist() == [1.5, 2.5]


@pytest.mark.gpu
def test_async_h2d_to_cuda_and_pinning() -> None:
    t = torch.arange(8)
    pinned = maybe_pin_memory(t)
    assert pinned.is_pinned()
    assert maybe_pin_memory(pinned) is pinned
    out = async_tensor_h2d([4, 5, 6], torch.int64, "cuda")
    assert out.is_cuda and out.cpu().tolist() == [4, 5, 6]


def test_step_constant_is_built_once_per_values_dtype_and_device() -> None:
    from tensorrt_llm._utils import step_constant

    cpu = torch.device("cpu")
    a = step_constant((0, 4, 9), torch.long, cpu)
    assert a is step_constant((0, 4, 9), torch.long, cpu)
    assert a.tolist() == [0, 4, 9] and a.dtype == torch.long
    assert step_constant((0, 4, 9), torch.int32, cpu) is not a
    assert step_constant((0, 2, 9), torch.long, cpu).tolist() == [0, 2, 9]


def test_a_capture_scope_keeps_the_constants_handed_out_in_it() -> None:
    """A CUDA graph reads cached constants by address: the scope around its capture holds
    each one it was handed (also one built before the scope), so the LRU cache dropping it
    cannot free memory the graph still reads; nothing is held outside a scope."""
    from tensorrt_llm._utils import _cached_constant, keeping_constants, kept, step_constant

    cpu = torch.device("cpu")
    before = step_constant((1, 2, 3), torch.long, cpu)
    with keeping_constants() as outer:
        assert step_constant((1, 2, 3), torch.long, cpu) is before
        with keeping_constants() as inner:
            fresh = step_constant((7, 8), torch.int32, cpu)
            extra = kept(torch.ones(2))
        _cached_constant.cache_clear()  # the cache forgets them; the scopes do not
    assert [t is before for t in outer] == [True]
    assert len(inner) == 2 and inner[0] is fresh and inner[1] is extra
    assert fresh.tolist() == [7, 8]
    step_constant((5,), torch.long, cpu)
    assert len(outer) == 1 and len(inner) == 2


def test_foreach_copy_groups_by_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed bf16 / float32 pairs: one `_foreach_copy_` per dtype (CUDA fuses only a one-dtype
    list), each pair copied exactly."""
    calls: list[set[torch.dtype]] = []
    real = torch._foreach_copy_

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        calls.append({t.dtype for t in (*dsts, *srcs)})
        real(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    srcs = [torch.randn(3, 4).to(d) for d in (torch.bfloat16, torch.float32) * 3]
    dsts = [torch.zeros_like(t) for t in srcs]
    foreach_copy_(dsts, srcs)
    assert sorted(calls, key=str) == [{torch.bfloat16}, {torch.float32}]
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    with pytest.raises(ValueError, match="destinations"):
        foreach_copy_(dsts[:1], srcs)
