"""Gated DeltaNet's causal-conv Triton kernels against the torch path: the decode update of the
pool rows, the varlen prefill (whole and as q/k/v planes), and the MTP rollback's conv state.

Without CUDA the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at tiny sizes; the
16-bit rounding is checked on the GPU (`@pytest.mark.gpu`, Qwen3.6-27B sizes)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.modules.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from tensorrt_llm._torch.modules.triton_kernels.causal_conv1d import (
    causal_conv1d_update_,
    causal_conv1d_varlen,
    causal_conv1d_varlen_planes,
)
from tensorrt_llm._torch.modules.triton_kernels.conv_rollback import causal_conv1d_rollback_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIGHT = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_conv_update_shifts_pool_rows_in_place(bias: bool) -> None:
    """300 channels: two programs, the second masked; x a strided view like the layer's."""
    gen = torch.Generator().manual_seed(0)
    dim, width = 300, 4
    weight = torch.randn(dim, width, generator=gen)
    b = torch.randn(dim, generator=gen) if bias else None
    pool = torch.randn(6, dim, width - 1, generator=gen)
    slots = torch.tensor([4, 1, 3])
    x = torch.randn(3, dim + 20, generator=gen)[:, :dim]
    rows = pool[slots].clone()
    pool_in = pool.clone()
    want = causal_conv1d_update(x, rows, weight, b)
    want_pool = pool.clone()
    want_pool[slots] = rows
    dev = [t.to(DEVICE) if t is not None else None for t in (x, weight, b, pool_in, slots)]
    got = causal_conv1d_update_(*dev)
    torch.testing.assert_close(got.cpu(), want, **TIGHT)
    torch.testing.assert_close(dev[3].cpu(), want_pool, **TIGHT)  # other rows untouched
    per_request = rows.clone().to(DEVICE)  # no slots: row n is request n
    causal_conv1d_update_(dev[0], dev[1], dev[2], per_request)
    causal_conv1d_update(x, rows, weight, b)
    torch.testing.assert_close(per_request.cpu(), rows, **TIGHT)
    with pytest.raises(ValueError, match="slots must be"):
        causal_conv1d_update_(dev[0], dev[1], dev[2], dev[3], dev[4][:2])


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_varlen_matches_torch_prefill(activation: str | None) -> None:
    """Sequences shorter than the state (1, 2), longer than a 64-token block (70), whole
    blocks (128, 64), carried and fresh; final states land in the rows given, not in the
    initial-state tensor."""
    gen = torch.Generator().manual_seed(1)
    dim, width = 200, 4
    lens, flags = (1, 70, 2, 128, 5, 64), (True, False, True, True, False, True)
    weight, b = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    x = torch.randn(sum(lens), dim + 8, generator=gen)[:, :dim]
    init = torch.randn(len(lens), dim, width - 1, generator=gen)
    want_states = init.clone()
    want = causal_conv1d_fn(x, weight, b, lens, want_states, flags, activation)
    finals = torch.zeros(8, dim, width - 1)
    rows = torch.tensor([7, 0, 3, 5, 2, 6])
    flags_d = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (x, weight, b, init, flags_d, finals, rows)]
    got = causal_conv1d_varlen(*dev[:3], lens, *dev[3:], activation)
    torch.testing.assert_close(got.cpu(), want, **TIGHT)
    torch.testing.assert_close(dev[5].cpu()[rows], want_states, **TIGHT)
    assert torch.equal(dev[5].cpu()[[1, 4]], torch.zeros(2, dim, width - 1))
    fresh = init.clone()
    want = causal_conv1d_fn(x, weight, None, lens, fresh, None, activation)
    got = causal_conv1d_varlen(dev[0], dev[1], None, lens, None, None, dev[5], None, activation)
    torch.testing.assert_close(got.cpu(), want, **TIGHT)
    torch.testing.assert_close(dev[5].cpu()[: len(lens)], fresh, **TIGHT)


def test_conv_varlen_planes_are_the_column_slices_contiguous() -> None:
    """Three contiguous planes equal to the column slices of the plain output; the cuts (40,
    90 of 200 channels) fall inside a 128-channel program, which then writes to two planes."""
    gen = torch.Generator().manual_seed(4)
    dim, width = 200, 4
    lens, flags = (3, 70, 40), (True, False, True)
    weight, b = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    x = torch.randn(sum(lens), dim + 8, generator=gen)[:, :dim]
    init = torch.randn(len(lens), dim, width - 1, generator=gen)
    flags_d = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (x, weight, b, init, flags_d)]
    want_finals, got_finals = (torch.zeros(3, dim, width - 1, device=DEVICE) for _ in range(2))
    want = causal_conv1d_varlen(*dev[:3], lens, *dev[3:], want_finals, None, "silu")
    planes = causal_conv1d_varlen_planes(
        *dev[:3], lens, *dev[3:], got_finals, None, "silu", (40, 90)
    )
    for got, cols in zip(planes, (slice(0, 40), slice(40, 90), slice(90, dim)), strict=True):
        assert got.is_contiguous()
        torch.testing.assert_close(got.cpu(), want[:, cols].cpu(), **TIGHT)
    assert planes[1].data_ptr() == planes[0].data_ptr() + planes[0].numel() * 4
    torch.testing.assert_close(got_finals, want_finals, **TIGHT)
    with pytest.raises(ValueError, match="three parts"):
        causal_conv1d_varlen_planes(*dev[:3], lens, *dev[3:], got_finals, None, None, (90, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_rollback_takes_the_last_inputs_up_to_the_kept_token(dtype: torch.dtype) -> None:
    """Rows keeping 1..5 of their inputs (kernel 4: the state is 3 columns): the state is
    columns keep.. keep + 2 of [saved state | inputs], the Triton kernel's equal to the torch
    path's and to that definition; other pool rows untouched."""
    gen = torch.Generator().manual_seed(8)
    dim, width, n = 300, 4, 5
    x = torch.randn(30, dim + 6, generator=gen).to(dtype)[:, :dim]  # strided rows
    initial = torch.randn(n + 1, dim, width - 1, generator=gen).to(dtype)
    pool = torch.randn(8, dim, width - 1, generator=gen).to(dtype)
    slots, init_rows = torch.tensor([6, 0, 3, 7, 2]), torch.tensor([5, 1, 0, 2, 4])
    starts, keeps = torch.tensor([0, 6, 12, 18, 24]), torch.tensor([1, 2, 3, 4, 5])
    want = pool.clone()
    for r in range(n):
        joined = torch.cat([initial[init_rows[r]], x[starts[r] : starts[r] + 6].t()], dim=1)
        want[slots[r]] = joined[:, keeps[r] : keeps[r] + width - 1]
    for backend in ("torch", "triton"):
        dev = [t.to(DEVICE) for t in (pool.clone(), slots, initial, init_rows, x, starts, keeps)]
        causal_conv1d_rollback_(*dev, backend=backend)
        assert torch.equal(dev[0].cpu(), want), backend
    with pytest.raises(ValueError, match="like slots"):
        causal_conv1d_rollback_(pool, slots, initial, init_rows[:2], x, starts, keeps)


@pytest.mark.gpu
def test_gpu_conv_varlen_27b_bf16_matches_torch() -> None:
    """8192 + 700 tokens over the 10240 conv channels, the second sequence carrying state."""
    torch.manual_seed(0)
    dim, lens = 10240, (8192, 700)
    weight = (torch.randn(dim, 4, device="cuda") * 0.5).bfloat16()
    x = torch.randn(sum(lens), dim, device="cuda").bfloat16()
    init = torch.randn(2, dim, 3, device="cuda").bfloat16()
    want_states = init.clone()
    want = causal_conv1d_fn(x, weight, None, lens, want_states, (False, True))
    finals = torch.empty_like(init)
    flags = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    got = causal_conv1d_varlen(x, weight, None, lens, init, flags, finals)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert torch.equal(finals, want_states)
