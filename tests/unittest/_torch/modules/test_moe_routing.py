"""The Triton MoE routing, alignment and GEMV kernels against their torch paths.

Without CUDA the kernels run under TRITON_INTERPRET=1 at tiny fp32 sizes; `gpu` tests use
Qwen3.6-35B-A3B's sizes (hidden 2048, 256 experts, top-8, experts and shared expert 512) in
bf16, with the shared expert fused, and check CUDA-graph capture.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():  # Must precede the first triton import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tensorrt_llm._torch.modules.fused_moe import MoE  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels.fused_moe import (  # noqa: E402
    expert_plan,
    fused_moe,
    fused_moe_ref,
    moe_align_block_size,
)
from tensorrt_llm._torch.modules.triton_kernels.moe_gemv import fused_moe_gemv  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels.moe_routing import (  # noqa: E402
    moe_align,
    moe_route,
    route_ref,
)
from tensorrt_llm._torch.modules.triton_kernels.moe_tiles import (  # noqa: E402
    BLOCK_SCALED_DECODE_TILES,
    BLOCK_SCALED_DECODE_TOKENS,
    BLOCK_SCALED_WIDE_DOWN_TOKENS,
    GemvTiles,
    MoETiles,
    pick_tiles,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _experts(num: int, hidden: int, inter: int, seed: int, dtype=torch.float32):
    gen = _gen(seed)
    w1 = torch.randn(num, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num, hidden, inter, generator=gen) * inter**-0.5
    return w1.to(DEVICE, dtype), w2.to(DEVICE, dtype)


@pytest.mark.parametrize(
    "tokens,experts,top_k,shared,renorm",
    [
        (3, 8, 2, False, True),
        (5, 8, 3, True, True),
        (40, 60, 4, True, False),
        (7, 16, 16, False, True),
    ],
)
def test_route_and_align_match_torch(tokens, experts, top_k, shared, renorm) -> None:
    logits = torch.randn(tokens, experts + shared, generator=_gen(tokens)).to(DEVICE)
    weights, ids, layout = moe_route(logits, top_k, renorm, shared, block_m=16, backend="triton")
    want_w, want_ids = route_ref(logits, top_k, renorm, shared)
    assert ids.dtype == torch.int32 and bool((ids.long() == want_ids).all())  # best first, too
    torch.testing.assert_close(weights, want_w)
    if shared:
        torch.testing.assert_close(weights[:, -1], torch.sigmoid(logits[:, -1]))
    # The stable per-expert order makes the layout equal the torch path's bit for bit.
    sorted_pairs, block_expert = moe_align_block_size(want_ids, experts + shared, 16)
    assert layout is not None
    assert bool((layout[0] == sorted_pairs).all()) and bool((layout[1] == block_expert).all())
    alone = moe_align(ids, experts + shared, 16)
    assert bool((alone[0] == sorted_pairs).all()) and bool((alone[1] == block_expert).all())


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_long_and_skewed_runs(block_m: int) -> None:
    """Runs of many blocks (a few experts, many tokens) and one expert taking most pairs (what
    expert parallelism's renumbering does), over several chunks of pairs."""
    ids = torch.randint(0, 5, (300, 2), generator=_gen(7))
    ids[::3, 0] = 0
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 1) % 5, ids[:, 1])
    want = moe_align_block_size(ids, 6, block_m)  # expert 5 gets nothing
    got = moe_align(ids.to(DEVICE), 6, block_m)
    assert bool((got[0].cpu() == want[0]).all()) and bool((got[1].cpu() == want[1]).all())


@pytest.mark.parametrize("tokens,block_m", [(128, 64), (15, 16), (1, 16)])
def test_align_decode_batch_at_35b_dims(tokens: int, block_m: int) -> None:
    """35B-A3B's 256 experts + the fused shared one, top-8 + 1: at 128 tokens the 1152 pairs
    span nine programs (chunks of 128), whose runs interleave; 15 tokens end a chunk early."""
    gen = _gen(tokens)
    ids = torch.stack([torch.randperm(256, generator=gen)[:8] for _ in range(tokens)])
    ids = torch.cat([ids, torch.full((tokens, 1), 256)], dim=1)
    want = moe_align_block_size(ids, 257, block_m)
    got = moe_align(ids.to(DEVICE, torch.int32), 257, block_m)
    assert bool((got[0].cpu() == want[0]).all()) and bool((got[1].cpu() == want[1]).all())


def test_route_ties_pick_the_lowest_ids() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0]], device=DEVICE)
    _, ids, _ = moe_route(logits, 3, backend="triton")
    assert ids.tolist() == [[1, 3, 2]]


def test_route_bf16_weights_round_like_the_torch_path() -> None:
    logits = torch.randn(6, 12, generator=_gen(2)).to(DEVICE, torch.bfloat16)
    weights, ids, _ = moe_route(logits, 4, True, True, backend="triton")
    want_w, want_ids = route_ref(logits, 4, True, True)
    assert weights.dtype == torch.bfloat16 and bool((ids.long() == want_ids).all())
    # Exact on the GPU; the interpreter's fp32 -> bf16 cast truncates (1 ulp at most).
    rtol = 0.0 if DEVICE.type == "cuda" else 2.0**-7
    torch.testing.assert_close(weights.float(), want_w.float(), atol=0.0, rtol=rtol)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("per_pair", [True, False])
def test_gemv_path_matches_ref(tokens: int, per_pair: bool) -> None:
    w1, w2 = _experts(6, 32, 24, 0)
    x = torch.randn(tokens, 32, generator=_gen(1)).to(DEVICE)
    weights, ids = route_ref(torch.randn(tokens, 6, generator=_gen(3)).to(DEVICE), 2)
    assert expert_plan(tokens, 2, 6, block_scaled=False) is None  # takes the GEMV kernels
    want = fused_moe_ref(x, w1, w2, ids, weights)
    torch.testing.assert_close(fused_moe(x, w1, w2, ids, weights, backend="triton"), want,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    tiles = GemvTiles(16, 16, 16, down_per_pair=per_pair)
    out = fused_moe_gemv(x, w1, w2, ids, weights, tiles)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("combine", ["sum", "atomic"])
def test_grouped_gemm_tiles_layout_and_combine(combine: str) -> None:
    w1, w2 = _experts(7, 32, 24, 4)  # 6 routed + 1 shared
    x = torch.randn(9, 32, generator=_gen(5)).to(DEVICE)
    logits = torch.randn(9, 7, generator=_gen(6)).to(DEVICE)
    weights, ids, layout = moe_route(logits, 2, True, True, block_m=16, backend="triton")
    want = fused_moe_ref(x, w1, w2, ids, weights)
    tiles = MoETiles(16, 16, 16, 32, 16, combine=combine)
    out = fused_moe(x, w1, w2, ids, weights, backend="triton", layout=layout, tiles=tiles)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not aligned"):
        fused_moe(x, w1, w2, ids, weights, backend="triton", layout=layout,
                  tiles=MoETiles(64, 16, 16, 16, 16))  # fmt: skip


@pytest.mark.parametrize("combine", ["sum", "atomic"])
def test_grouped_gemm_16bit_partials(combine: str) -> None:
    """16-bit activations: "sum" keeps each pair's weighted output in the activation dtype and
    adds a token's k of them in fp32; the result stays within about one rounding of the torch
    reference (which rounds each expert's output to 16 bits too) and of the fp32 maths.
    (fp16: the CPU interpreter has no bf16 dot.)"""
    w1, w2 = (w.half() for w in _experts(7, 32, 24, 4))
    x = torch.randn(9, 32, generator=_gen(5)).to(DEVICE).half()
    logits = torch.randn(9, 7, generator=_gen(6)).to(DEVICE)
    weights, ids, layout = moe_route(logits, 2, True, True, block_m=16, backend="triton")
    tiles = MoETiles(16, 16, 16, 32, 16, combine=combine)
    out = fused_moe(x, w1, w2, ids, weights, backend="triton", layout=layout, tiles=tiles)
    assert out.dtype == torch.float16
    want16 = fused_moe_ref(x, w1, w2, ids, weights)
    torch.testing.assert_close(out, want16, atol=2e-3, rtol=2e-3)
    want32 = fused_moe_ref(x.float(), w1.float(), w2.float(), ids, weights)
    torch.testing.assert_close(out.float(), want32, atol=2e-3, rtol=2e-3)


@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_fused_block_on_the_triton_path_matches_hf(
    tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MoE.forward` with every kernel on Triton (the interpreter on CPU): the routing kernel,
    its layout or the GEMV kernels, and the shared expert fused; against HF's block."""
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    import tensorrt_llm._torch.modules.fused_moe.moe as moe_mod
    import tensorrt_llm._torch.modules.triton_kernels.fused_moe as fused_mod
    import tensorrt_llm._torch.modules.triton_kernels.moe_routing as routing_mod

    if DEVICE.type == "cpu":
        for mod in (moe_mod, fused_mod, routing_mod):
            monkeypatch.setattr(mod, "use_triton", lambda name, device, backend: True)
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2)
    config = Qwen3NextConfig(**sizes, shared_expert_intermediate_size=16)
    config._experts_implementation = "eager"  # type: ignore[attr-defined]
    hf = Qwen3NextSparseMoeBlock(config).eval()
    for p in hf.parameters():
        p.copy_(torch.randn_like(p) * 0.3)
    ours = MoE.from_config(config).eval()
    ours.load_weights(hf.state_dict())
    assert ours.shared_fused
    ours.to(DEVICE)
    x = torch.randn(tokens, 32)
    want = hf(x[None])[0]
    torch.testing.assert_close(ours(x.to(DEVICE)).cpu(), want, atol=1e-4, rtol=1e-4)


def test_tiles_depend_on_the_token_class_only() -> None:
    for tokens in (5, 6, 7, 8):  # one warm-up class: one set of compiled variants
        assert pick_tiles(tokens, 9, 257) == pick_tiles(8, 9, 257)
    assert pick_tiles(512, 9, 257).block_m == 64 and pick_tiles(64, 9, 257).block_m == 16
    with pytest.raises(ValueError, match="power of two"):
        MoETiles(16, 24, 16, 16, 16)
    with pytest.raises(ValueError, match="down_num_warps"):
        MoETiles(16, 16, 16, 16, 16, down_num_warps=3)


def test_block_scaled_prefill_takes_wide_down_tiles() -> None:
    """Block-FP8 steps past BLOCK_SCALED_WIDE_DOWN_TOKENS: down N 256 with 8 warps, the rest of
    the bucket's tiles and its BLOCK_M kept; 16-bit experts and smaller steps unchanged."""
    big = BLOCK_SCALED_WIDE_DOWN_TOKENS + 1
    wide = pick_tiles(big, 9, 257, block_scaled=True)
    plain = pick_tiles(big, 9, 257)
    assert (wide.down_n, wide.down_num_warps) == (256, 8)
    assert replace(wide, down_n=plain.down_n, down_num_warps=None) == plain
    assert pick_tiles(8192, 9, 257, block_scaled=True) == wide  # one warm-up class
    small = BLOCK_SCALED_WIDE_DOWN_TOKENS
    assert pick_tiles(small, 9, 257, block_scaled=True) == pick_tiles(small, 9, 257)


def test_block_scaled_decode_takes_the_decode_tiles() -> None:
    """Block-FP8 decode steps (17-256 tokens) take BLOCK_SCALED_DECODE_TILES, BLOCK_M 16 even
    where the pair count would give 16-bit experts BLOCK_M 64; outside that range, and for
    16-bit experts, the table's tiles; an explicit block_m still wins."""
    low, high = BLOCK_SCALED_DECODE_TOKENS
    for tokens in (low // 2 + 1, low, 100, 128, high):  # token classes 32 to 256
        assert pick_tiles(tokens, 9, 257, block_scaled=True) == BLOCK_SCALED_DECODE_TILES
    assert pick_tiles(128, 9, 257).block_m == 64  # 16-bit experts: the many-pairs rule
    assert pick_tiles(128, 9, 257, block_scaled=True).block_m == 16
    assert pick_tiles(high + 1, 9, 257, block_scaled=True) == pick_tiles(high + 1, 9, 257)
    assert pick_tiles(16, 9, 257, block_scaled=True) == pick_tiles(16, 9, 257)
    assert pick_tiles(128, 9, 257, block_m=64, block_scaled=True).block_m == 64


# ----------------------------------------------------------------- GPU, real sizes

H, E, K, INTER = 2048, 256, 8, 512


def _moe_35b() -> MoE:
    torch.manual_seed(0)
    moe = MoE(E, K, H, INTER, shared_expert_intermediate_size=INTER, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    return moe.to(DEVICE).eval()


def _no_boundary_tie(probs: torch.Tensor, k: int) -> torch.Tensor:
    top = probs.topk(k + 1, dim=-1).values
    return top[:, k - 1] != top[:, k]


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_fused_block_real_35b_dims_gpu(tokens: int) -> None:
    moe = _moe_35b()
    x = torch.randn(tokens, H, device=DEVICE, dtype=torch.bfloat16)
    shared, gate = moe.shared_expert, moe.shared_expert_gate
    assert shared is not None and gate is not None
    unfused_logits = F.linear(x, moe.gate.weight)
    # The torch path in fp32: routed experts, then HF's gated shared expert.
    w1, w2 = moe.experts.gate_up_proj.float(), moe.experts.down_proj.float()
    gate_out, up = F.linear(x.float(), shared.gate_up_proj.weight.float()).chunk(2, dim=-1)
    shared_out = torch.sigmoid(gate(x)).float() * F.linear(
        F.silu(gate_out) * up, shared.down_proj.weight.float()
    )
    assert moe.fuse_shared_expert_()
    fused_logits = moe.gate.logits(x)  # [T, E + 1], a strided view past the padding
    assert fused_logits.shape[1] == E + 1 and fused_logits.stride(0) % 8 == 0
    # NOTE: cuBLAS may take another kernel for E + 1 router rows than for E, so the routed
    # logits can differ from the unfused GEMM's by a bf16 rounding (seen on the H200: 0.0156);
    # the reference routes on the fused GEMM's logits so near-ties decide alike.
    torch.testing.assert_close(fused_logits[:, :E], unfused_logits, atol=2e-2, rtol=1.6e-2)
    logits = fused_logits[:, :E]
    w_ref, ids_ref = route_ref(logits, K)
    want = fused_moe_ref(x.float(), w1, w2, ids_ref, w_ref.float()) + shared_out
    weights, ids, _ = moe_route(fused_logits, K, True, True)
    probs = F.softmax(logits.float(), -1)
    keep = _no_boundary_tie(probs, K)
    got, ref = ids[:, :K].long().sort(-1).values, ids_ref.sort(-1).values
    assert bool((got[keep] == ref[keep]).all())  # the same experts where no tie decides
    # Where one does: the lowest ids among the tied (moe_routing.py), as CUDA's topk picks.
    lowest = probs.neg().sort(dim=-1, stable=True).indices[:, :K].sort(-1).values
    assert bool((got == lowest).all())
    assert bool((ids[:, K] == E).all())
    out = moe(x).float()
    err = (out - want)[keep].norm() / want[keep].norm()
    assert float(err) < 2e-2, float(err)


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_fused_block_under_graph_capture_gpu(tokens: int) -> None:
    moe = _moe_35b()
    assert moe.fuse_shared_expert_()
    x = torch.randn(tokens, H, device=DEVICE, dtype=torch.bfloat16)
    moe(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(out, moe(fresh), atol=1e-2, rtol=1e-2)
