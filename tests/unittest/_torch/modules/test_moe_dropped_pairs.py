"""Dropped (token, expert) pairs (id E: expert parallelism's pairs of other ranks) on every
MoE kernel path: each equals the reference computed without those pairs, under
TRITON_INTERPRET=1 at tiny fp32 sizes without CUDA."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Must precede the first triton import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tensorrt_llm._torch.modules.triton_kernels.fused_moe import (  # noqa: E402
    fused_moe,
    fused_moe_dense_ref,
    fused_moe_ref,
    moe_align_block_size,
)
from tensorrt_llm._torch.modules.triton_kernels.moe_gemv import fused_moe_gemv  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels.moe_routing import moe_align  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels.moe_tiles import (  # noqa: E402
    GemvTiles,
    MoETiles,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, H, INTER, K = 4, 32, 24, 3


def _case(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """x, weights, ids with about half the pairs dropped (id E), and the reference: the
    kept pairs alone, each dropped pair's weight zeroed on a real expert."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * INTER, H, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, INTER, generator=gen) * INTER**-0.5
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E + 2, generator=gen)[:K] for _ in range(tokens)])
    ids = ids.clamp(max=E)  # ids E and E + 1 both become the dropped id E
    weights = torch.rand(tokens, K, generator=gen)
    dropped = ids == E
    assert bool(dropped.any()) and bool((~dropped).any())
    kept_ids = ids.masked_fill(dropped, 0)
    want = fused_moe_ref(x, w1, w2, kept_ids, weights.masked_fill(dropped, 0.0))
    args = (x, w1, w2, ids, weights)
    return tuple(t.to(DEVICE) for t in (*args, want))


def test_torch_paths_skip_dropped_pairs() -> None:
    x, w1, w2, ids, weights, want = _case(7, 0)
    # The weights of dropped pairs are not zero: only their id keeps them out.
    for ref in (fused_moe_ref, fused_moe_dense_ref):
        torch.testing.assert_close(ref(x, w1, w2, ids, weights), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [16, 32])
def test_alignment_leaves_dropped_pairs_out(block_m: int) -> None:
    _, _, _, ids, _, _ = _case(11, 1)
    sorted_pairs, block_expert = moe_align_block_size(ids, E, block_m)
    flat = ids.reshape(-1).cpu()
    placed = sorted_pairs[sorted_pairs < flat.numel()].cpu()
    assert sorted(placed.tolist()) == torch.nonzero(flat < E).flatten().tolist()
    # Every placed pair sits in a block of its expert.
    owner = block_expert.cpu().repeat_interleave(block_m)[sorted_pairs.cpu() < flat.numel()]
    assert bool((flat[placed] == owner).all())
    got = moe_align(ids, E, block_m)  # the Triton program, histogram by itself
    assert bool((got[0] == sorted_pairs).all()) and bool((got[1] == block_expert).all())


@pytest.mark.parametrize("combine", ["sum", "atomic"])
def test_grouped_gemm_skips_dropped_pairs(combine: str) -> None:
    x, w1, w2, ids, weights, want = _case(9, 2)
    tiles = MoETiles(16, 16, 16, 32, 16, combine=combine)
    out = fused_moe(x, w1, w2, ids, weights, backend="triton", tiles=tiles, dropped=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_pair", [True, False])
def test_gemv_skips_dropped_pairs(per_pair: bool) -> None:
    x, w1, w2, ids, weights, want = _case(3, 3)
    ids[0] = E  # a token with every pair dropped gets zeros
    want[0] = 0.0
    tiles = GemvTiles(16, 16, 16, down_per_pair=per_pair)
    out = fused_moe_gemv(x, w1, w2, ids, weights, tiles)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    routed = fused_moe(x, w1, w2, ids, weights, backend="triton", dropped=True)
    torch.testing.assert_close(routed, want, atol=1e-5, rtol=1e-5)
