"""Triton kernels vs their torch references: fused (m)RoPE, pos-embed interpolation, fused MoE.

Without CUDA the kernels run under TRITON_INTERPRET=1 at tiny sizes; `gpu` tests use real sizes.
"""

from __future__ import annotations

import logging
import os

import torch

if not torch.cuda.is_available():  # Must precede the first triton import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tensorrt_llm._torch.models.modeling_qwen3vl_vision import (  # noqa: E402
    interpolate_pos_embed_reference,
)
from tensorrt_llm._torch.modules import triton_kernels  # noqa: E402
from tensorrt_llm._torch.modules.fused_moe.moe import fused_moe_ref  # noqa: E402
from tensorrt_llm._torch.modules.rotary_embedding import (  # noqa: E402
    MRotaryEmbedding,
    RotaryEmbedding,
    apply_rotary_emb,
)
from tensorrt_llm._torch.modules.triton_kernels.fused_moe import (  # noqa: E402
    fused_moe,
    moe_align_block_size,
)
from tensorrt_llm._torch.modules.triton_kernels.mrope import apply_rotary_qk_, rope_qk_  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels.pos_embed_interp import (  # noqa: E402
    interpolate_pos_embed,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ("triton", "torch")

# (head_dim, rotary_dim, mrope_section, interleaved): Qwen2/2.5-VL, Qwen3-VL, Qwen3.5 (partial).
ROPE_LAYOUTS = {
    "contiguous": (16, 16, (2, 3, 3), False),
    "interleaved": (16, 16, (3, 3, 2), True),
    "partial_interleaved": (32, 16, (3, 3, 2), True),
}


def _rope_reference(
    rope: RotaryEmbedding, qkv: torch.Tensor, heads: tuple[int, int], pos: torch.Tensor
) -> torch.Tensor:
    """The existing torch path on a fused qkv: `get_cos_sin` + `apply_rotary_emb` on q and k."""
    num_heads, num_kv = heads
    d = rope.head_dim
    q, k, v = qkv.split([num_heads * d, num_kv * d, num_kv * d], dim=-1)
    cos_sin = rope.get_cos_sin(pos)
    q = apply_rotary_emb(q.reshape(-1, num_heads, d), cos_sin).flatten(1)
    k = apply_rotary_emb(k.reshape(-1, num_kv, d), cos_sin).flatten(1)
    return torch.cat([q, k, v], dim=-1)


def _rope_inplace(
    rope: RotaryEmbedding,
    qkv: torch.Tensor,
    heads: tuple[int, int],
    pos: torch.Tensor,
    backend: str,
    flag: torch.Tensor | None = None,
) -> torch.Tensor:
    num_heads, num_kv = heads
    d = rope.head_dim
    out = qkv.clone()
    q, k, _ = out.split([num_heads * d, num_kv * d, num_kv * d], dim=-1)  # strided views
    apply_rotary_qk_(rope, q, k, pos, flag, backend=backend)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", sorted(ROPE_LAYOUTS))
def test_mrope_matches_torch_path(layout: str, backend: str) -> None:
    head_dim, rotary_dim, section, interleaved = ROPE_LAYOUTS[layout]
    rope = MRotaryEmbedding(head_dim, rotary_dim, 1e4, 64, section, interleaved).to(DEVICE)
    torch.manual_seed(0)
    heads, tokens = (4, 2), 7
    qkv = torch.randn(tokens, (heads[0] + 2 * heads[1]) * head_dim, device=DEVICE)
    pos = torch.randint(0, 64, (3, tokens), device=DEVICE, dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = _rope_inplace(rope, qkv, heads, pos, backend, flag)
    expected = _rope_reference(rope, qkv, heads, pos.long())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert int(flag[0]) == 0
    assert not torch.equal(out, qkv)  # the rotation really happened in place


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["qwen3", "qwen3.5"])
@pytest.mark.parametrize("layout", ["interleaved", "partial_interleaved"])
def test_fused_qk_norm_matches_norm_then_rope(layout: str, zero_centered: bool, backend: str):
    """`rope_qk_(..., q_norm_weight=, k_norm_weight=)` == per-head `rms_norm` of q and k, then
    the rotation; on strided q/k views of a fused qkv, partial rotary included (the channels
    past rotary_dim must come out normalised, not rotated and not left raw)."""
    from tensorrt_llm._torch.modules.triton_kernels.rms_norm import rms_norm_torch

    head_dim, rotary_dim, section, interleaved = ROPE_LAYOUTS[layout]
    rope = MRotaryEmbedding(head_dim, rotary_dim, 1e4, 64, section, interleaved).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    heads, tokens = (4, 2), 5
    qkv = (torch.randn(tokens, (heads[0] + 2 * heads[1]) * head_dim, generator=gen) * 3).to(DEVICE)
    w_q = (torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE)
    w_k = (torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE)
    pos = torch.randint(0, 64, (3, tokens), generator=gen, dtype=torch.int32).to(DEVICE)
    eps = 1e-6

    expected = qkv.clone()
    q, k, _ = expected.split(
        [heads[0] * head_dim, heads[1] * head_dim, heads[1] * head_dim], dim=-1
    )
    q3, k3 = q.view(tokens, heads[0], head_dim), k.view(tokens, heads[1], head_dim)
    q3.copy_(rms_norm_torch(q3, w_q, eps, zero_centered=zero_centered))
    k3.copy_(rms_norm_torch(k3, w_k, eps, zero_centered=zero_centered))
    apply_rotary_qk_(rope, q, k, pos, backend="torch")

    axes = rope.channel_axes.reshape(-1)[: rotary_dim // 2]
    # Positions looked up in the kernel, and a per-token table (what the attention layers pass).
    for table, positions in ((rope.cos_sin_table, pos), (rope.get_cos_sin(pos.long()), None)):
        out = qkv.clone()
        sizes = [heads[0] * head_dim, heads[1] * head_dim, heads[1] * head_dim]
        q, k, _ = out.split(sizes, dim=-1)
        rope_qk_(
            q, k, table, head_dim, positions, axes, backend=backend,
            q_norm_weight=w_q, k_norm_weight=w_k, norm_eps=eps, zero_centered=zero_centered,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("zero_centered", [False, True], ids=["qwen3", "qwen3.5"])
def test_gpu_fused_qk_norm_rounds_like_the_separate_kernels(zero_centered: bool) -> None:
    """bf16 at Qwen3-VL / Qwen3.5 head sizes: fused norm+rope equals the norm kernel followed
    by the rope kernel (the normalised values are rounded to bf16 before the rotation)."""
    from tensorrt_llm._torch.modules.triton_kernels.rms_norm import rms_norm

    for head_dim, rotary_dim, section in ((128, 128, (24, 20, 20)), (256, 64, (11, 11, 10))):
        rope = MRotaryEmbedding(head_dim, rotary_dim, 1e6, 4096, section, True).cuda()
        torch.manual_seed(head_dim)
        heads, tokens = (32, 8), 37
        qkv = torch.randn(tokens, (heads[0] + 2 * heads[1]) * head_dim, device="cuda") * 4
        qkv = qkv.bfloat16()
        w_q = (torch.rand(head_dim, device="cuda") + 0.5).bfloat16()
        w_k = (torch.rand(head_dim, device="cuda") + 0.5).bfloat16()
        pos = torch.randint(0, 4096, (3, tokens), device="cuda", dtype=torch.int32)
        sizes = [heads[0] * head_dim, heads[1] * head_dim, heads[1] * head_dim]
        axes = rope.channel_axes.reshape(-1)[: rotary_dim // 2]

        separate = qkv.clone()
        q, k, _ = separate.split(sizes, dim=-1)
        q3, k3 = q.view(tokens, -1, head_dim), k.view(tokens, -1, head_dim)
        q3.copy_(rms_norm(q3, w_q, 1e-6, zero_centered=zero_centered))
        k3.copy_(rms_norm(k3, w_k, 1e-6, zero_centered=zero_centered))
        rope_qk_(q, k, rope.cos_sin_table, head_dim, pos, axes)

        fused = qkv.clone()
        q, k, _ = fused.split(sizes, dim=-1)
        rope_qk_(
            q, k, rope.cos_sin_table, head_dim, pos, axes,
            q_norm_weight=w_q, k_norm_weight=w_k, norm_eps=1e-6, zero_centered=zero_centered,
        )  # fmt: skip
        differ = (fused != separate).float().mean().item()
        assert differ < 0.01, differ  # reduction order only
        torch.testing.assert_close(fused.float(), separate.float(), atol=2e-2, rtol=1e-2)


def test_fused_qk_norm_bad_weights() -> None:
    rope = RotaryEmbedding(16, 16, 1e4, 8).to(DEVICE)
    q, k = torch.randn(2, 32, device=DEVICE), torch.randn(2, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        rope_qk_(q, k, rope.cos_sin_table, 16, torch.zeros(2, dtype=torch.long), q_norm_weight=w)
    with pytest.raises(ValueError, match=r"k_norm_weight must be \[16\]"):
        rope_qk_(
            q, k, rope.cos_sin_table, 16, torch.zeros(2, dtype=torch.long),
            q_norm_weight=w, k_norm_weight=torch.ones(8, device=DEVICE),
        )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_rope_and_precomputed_table(backend: str) -> None:
    rope = RotaryEmbedding(16, 8, 1e4, 32).to(DEVICE)
    torch.manual_seed(1)
    qkv = torch.randn(5, (3 + 2) * 16, device=DEVICE)
    pos = torch.tensor([0, 3, 31, 7, 7], device=DEVICE)
    expected = _rope_reference(rope, qkv, (3, 1), pos)
    torch.testing.assert_close(_rope_inplace(rope, qkv, (3, 1), pos, backend), expected)
    # position_ids=None: the table is already per token (what `get_cos_sin` returns).
    out = qkv.clone()
    q, k, _ = out.split([48, 16, 16], dim=-1)
    rope_qk_(q, k, rope.get_cos_sin(pos), 16, backend=backend)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mrope_out_of_range_positions_clamp_and_flag(backend: str) -> None:
    rope = MRotaryEmbedding(16, 16, 1e4, 32, (3, 3, 2), True).to(DEVICE)
    torch.manual_seed(2)
    qkv = torch.randn(4, 4 * 16, device=DEVICE)
    pos = torch.randint(0, 32, (3, 4), device=DEVICE)
    bad = pos.clone()
    bad[1, 2], bad[0, 0] = 40, -3
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = _rope_inplace(rope, qkv, (2, 1), bad, backend, flag)
    assert int(flag[0]) == 1
    expected = _rope_reference(rope, qkv, (2, 1), bad.clamp(0, 31))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_mrope_rejects_bad_inputs() -> None:
    rope = MRotaryEmbedding(16, 16, 1e4, 32, (3, 3, 2), True)
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    with pytest.raises(ValueError, match="position_ids"):
        apply_rotary_qk_(rope, q, k, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="head_dim"):
        apply_rotary_qk_(rope, torch.randn(3, 30), k, torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="channel_axes"):
        rope_qk_(q, k, rope.cos_sin_table, 16, torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="backend"):
        apply_rotary_qk_(rope, q, k, torch.zeros(3, dtype=torch.long), backend="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "grids",
    [[(1, 4, 4)], [(1, 4, 6)], [(2, 6, 2)], [(1, 2, 8), (3, 6, 4), (1, 10, 12)]],
    ids=["square", "wide", "frames", "mixed"],
)
def test_pos_embed_interp_matches_reference(grids: list[tuple[int, int, int]], backend: str):
    side, merge = 5, 2
    torch.manual_seed(3)
    weight = torch.randn(side * side + 2, 24, device=DEVICE)  # extra rows are ignored
    expected = interpolate_pos_embed_reference(weight, torch.tensor(grids), side, merge)
    out = interpolate_pos_embed(weight, grids, side, merge, backend=backend)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_pos_embed_interp_rejects_bad_grids() -> None:
    weight = torch.randn(16, 8)
    with pytest.raises(ValueError, match="divisible"):
        interpolate_pos_embed(weight, [(1, 3, 4)], 4, 2)
    with pytest.raises(ValueError, match="pos_embed_weight"):
        interpolate_pos_embed(weight, [(1, 4, 4)], 5, 2)


def _moe_inputs(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=gen)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] = -1e4  # expert 0 never gets a token: an empty run
    topk_w, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
    tensors = (x.to(dtype), w1.to(dtype), w2.to(dtype), topk_ids, topk_w / topk_w.sum(-1, True))
    return tuple(t.to(DEVICE) for t in tensors)


def test_moe_align_block_size_layout() -> None:
    topk_ids = torch.tensor([[2, 1], [3, 2], [2, 1], [2, 3], [5, 2]])
    sorted_pairs, block_expert = moe_align_block_size(topk_ids, 6, 4)
    flat = topk_ids.reshape(-1)
    real = sorted_pairs[sorted_pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # every pair exactly once
    for block, expert in enumerate(block_expert.tolist()):
        pairs = sorted_pairs[block * 4 : (block + 1) * 4]
        pairs = pairs[pairs < flat.numel()]
        if expert == 6:
            assert pairs.numel() == 0
        else:
            assert pairs.numel() > 0 and bool((flat[pairs.long()] == expert).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_fused_moe_fp32_matches_ref(top_k: int, backend: str) -> None:
    x, w1, w2, ids, weights = _moe_inputs(9, 32, 24, 4, top_k, torch.float32)
    expected = fused_moe_ref(x, w1, w2, ids, weights)
    out = fused_moe(x, w1, w2, ids, weights, backend=backend, block_m=16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fused_moe_rejects_bad_shapes() -> None:
    x, w1, w2, ids, weights = _moe_inputs(3, 32, 16, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_moe(x, w1, w2.transpose(1, 2), ids, weights)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w1, w2, ids[:2], weights[:2])


def test_dispatch_choice(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    assert not triton_kernels.use_triton("k", torch.device("cpu"), "auto")
    with pytest.raises(ValueError, match="backend"):
        triton_kernels.use_triton("k", torch.device("cpu"), "fast")
    monkeypatch.setattr(triton_kernels, "HAS_TRITON", False)
    monkeypatch.setattr(triton_kernels, "_warned", set())
    with caplog.at_level(logging.WARNING):
        assert not triton_kernels.use_triton("k", torch.device("cuda"), "auto")
        assert not triton_kernels.use_triton("k", torch.device("cuda"), "auto")
    assert sum("triton is not installed" in r.message for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="not installed"):
        triton_kernels.use_triton("k", torch.device("cuda"), "triton")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "head_dim,rotary_dim,section", [(128, 128, (24, 20, 20)), (256, 64, (11, 11, 10))]
)
def test_mrope_bf16_real_sizes_gpu(head_dim: int, rotary_dim: int, section: tuple[int, ...]):
    rope = MRotaryEmbedding(head_dim, rotary_dim, 1e6, 8192, section, True).to("cuda")
    torch.manual_seed(5)
    heads, tokens = (32, 4), 1000
    qkv = torch.randn(tokens, 40 * head_dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (3, tokens), device="cuda")
    out = _rope_inplace(rope, qkv, heads, pos, "auto")
    torch.testing.assert_close(out, _rope_reference(rope, qkv, heads, pos), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_pos_embed_interp_real_size_gpu() -> None:
    weight = torch.randn(48 * 48, 1152, device="cuda", dtype=torch.bfloat16)
    grids = [(1, 64, 92), (4, 30, 54)]
    expected = interpolate_pos_embed_reference(weight, torch.tensor(grids), 48, 2)
    out = interpolate_pos_embed(weight, grids, 48, 2)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_fused_moe_bf16_real_sizes_gpu() -> None:
    x, w1, w2, ids, weights = _moe_inputs(300, 1024, 768, 32, 4, torch.bfloat16)
    expected = fused_moe_ref(x.float(), w1.float(), w2.float(), ids, weights)
    out = fused_moe(x, w1, w2, ids, weights)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_fused_moe_cuda_graph_capture_gpu() -> None:
    x, w1, w2, ids, weights = _moe_inputs(16, 256, 128, 8, 2, torch.bfloat16)
    static = [x.clone(), ids.clone(), weights.clone()]
    fused_moe(static[0], w1, w2, static[1], static[2])  # warm up: compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w1, w2, static[1], static[2])
    for step in range(2):  # replay twice, with fresh routing each time
        new = _moe_inputs(16, 256, 128, 8, 2, torch.bfloat16)
        x_new, ids_new = new[0] * (step + 1), ids.roll(step + 1, dims=0)
        for dst, src in zip(static, (x_new, ids_new, weights), strict=True):
            dst.copy_(src)
        graph.replay()
        expected = fused_moe(x_new, w1, w2, ids_new, weights)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_pdl_can_be_turned_off_is_cuda_only_and_decode_sized(monkeypatch) -> None:
    """Programmatic dependent launch: off when TRTLLM_PDL=0, never on the CPU
    (the interpreter has no grid-dependency instructions), where the kernels get USE_PDL=False
    and no `launch_pdl` option, and never for large grids."""
    monkeypatch.setattr(triton_kernels, "PDL_REQUESTED", False)
    assert triton_kernels.pdl_launch_kwargs(torch.device("cuda"), 64) == {"USE_PDL": False}
    monkeypatch.setattr(triton_kernels, "PDL_REQUESTED", True)
    assert triton_kernels.pdl_launch_kwargs(torch.device("cpu"), 64) == {"USE_PDL": False}
    # Prefill-sized grids never use it (measured slower), even when requested on a GPU.
    assert triton_kernels.pdl_launch_kwargs(torch.device("cuda"), 100_000) == {"USE_PDL": False}
    if not torch.cuda.is_available():
        # Requested on the CPU, the kernels still run (and give the same result) under the
        # interpreter: USE_PDL stays False there.
        x = torch.randn(3, 16)
        out = rope_qk_(x.view(3, 2, 8).clone(), x.view(3, 2, 8).clone(), torch.randn(3, 8), 8,
                       backend="triton")  # fmt: skip
        assert out[0].shape == (3, 2, 8)
