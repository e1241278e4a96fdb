"""Pinned-staging helpers."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._utils import async_tensor_h2d, maybe_pin_memory, prefer_pinned


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
