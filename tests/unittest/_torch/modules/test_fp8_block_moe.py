"""Block-FP8 MoE experts: the fused MoE kernel's block-scaled path (interpreter on the CPU)
against its torch path and against dequantize-then-16-bit-reference; HF-named FP8 expert
loading (per-expert and stacked), its errors, and `quantize_fp8_block_()`."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig

from tensorrt_llm._torch.modules.fused_moe import MoE, MoEExperts, softmax_topk
from tensorrt_llm._torch.modules.fused_moe.fp8_experts import rows_of_scales
from tensorrt_llm._torch.modules.triton_kernels import HAS_TRITON
from tensorrt_llm._torch.modules.triton_kernels import fp8_block as fb
from tensorrt_llm._torch.modules.triton_kernels.fused_moe import fused_moe
from tensorrt_llm._torch.modules.triton_kernels.fused_moe_ref import BlockScales, fused_moe_ref

E, H, INTER, TOP_K = 4, 300, 72, 2  # I % 128 != 0: row-granular gate_up scales
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(num: int, hidden: int, inter: int, seed: int = 0) -> MoEExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = MoEExperts(num, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(num, 2 * inter, hidden, generator=gen) * 0.1)
        experts.down_proj.copy_(torch.randn(num, hidden, inter, generator=gen) * 0.1)
    return experts


def _routing(tokens: int, num: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return softmax_topk(torch.randn(tokens, num, generator=gen), top_k)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_quantize_fp8_block_equals_the_release_rule_per_expert() -> None:
    experts = _experts(E, H, INTER)
    w13, w2 = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    experts.quantize_fp8_block_()
    assert experts.weight_block_size == (128, 128)
    assert experts.gate_up_proj.dtype == fb.FP8_DTYPE
    assert experts.gate_up_proj_scale_inv is not None and experts.down_proj_scale_inv is not None
    assert experts.gate_up_proj_scale_inv.shape == (E, 2 * INTER, 3)  # row-granular
    for e in range(E):
        for rows, part in ((slice(0, INTER), w13[e, :INTER]), (slice(INTER, None), w13[e, INTER:])):
            q, s = fb.quantize_weight_fp8_block(part)
            assert torch.equal(experts.gate_up_proj[e, rows].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(
                experts.gate_up_proj_scale_inv[e, rows], rows_of_scales(s, 128, INTER)
            )
        q, s = fb.quantize_weight_fp8_block(w2[e])
        assert torch.equal(experts.down_proj[e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(experts.down_proj_scale_inv[e], s)
    with pytest.raises(ValueError, match="block-FP8 already"):
        experts.quantize_fp8_block_()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("inter", [INTER, 128])
def test_block_fp8_kernel_matches_references(tokens: int, inter: int) -> None:
    experts = _experts(E, H, inter, seed=tokens)
    w13_16, w2_16 = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    experts.quantize_fp8_block_()
    scales = experts.block_scales()
    assert scales is not None
    weights, ids = _routing(tokens, E, TOP_K, tokens)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(5))
    w13, w2 = experts.gate_up_proj.data.to(DEV), experts.down_proj.data.to(DEV)
    sc = BlockScales(
        scales.gate_up.to(DEV), scales.down.to(DEV), scales.gate_up_block, scales.down_block
    )
    x, weights, ids = x.to(DEV), weights.to(DEV), ids.to(DEV)
    # fp32 activations: the kernel and its torch path quantize identical values.
    got = fused_moe(x, w13, w2, ids, weights, backend="triton", scales=sc)
    want = fused_moe_ref(x, w13, w2, ids, weights, scales=sc)
    assert _rel(got, want) < 1e-5
    # bf16: act's rounding can flip an e4m3 step here and there.
    xb, wb = x.bfloat16(), weights.bfloat16()
    got_b = fused_moe(xb, w13, w2, ids, wb, backend="triton", scales=sc)
    assert got_b.dtype == torch.bfloat16
    assert _rel(got_b, fused_moe_ref(xb, w13, w2, ids, wb, scales=sc)) < 3e-2
    # Against the 16-bit experts the FP8 weights and activations stand for (~4% per GEMM).
    deq13 = torch.stack(
        [fb.dequantize_weight_fp8_block(w13[e], sc.gate_up[e], sc.gate_up_block) for e in range(E)]
    )
    deq2 = torch.stack([fb.dequantize_weight_fp8_block(w2[e], sc.down[e]) for e in range(E)])
    dense = fused_moe_ref(x, deq13, deq2, ids, weights)
    assert _rel(got, dense) < 0.08
    assert _rel(dense, fused_moe_ref(x, w13_16.to(DEV), w2_16.to(DEV), ids, weights)) < 0.08


def test_fused_moe_refuses_e4m3_without_scales() -> None:
    experts = _experts(E, H, INTER)
    experts.quantize_fp8_block_()
    weights, ids = _routing(2, E, TOP_K, 0)
    with pytest.raises(ValueError, match="need their block scales"):
        fused_moe(torch.randn(2, H), experts.gate_up_proj, experts.down_proj, ids, weights)


def _hf_fp8_state(experts16: MoEExperts, gate: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a `-FP8` release holds for one MoE block: per-expert e4m3 + weight_scale_inv."""
    state = {"gate.weight": gate}
    inter = experts16.intermediate_size
    for e in range(experts16.num_experts):
        w13, w2 = experts16.gate_up_proj[e].detach(), experts16.down_proj[e].detach()
        for proj, w in (("gate_proj", w13[:inter]), ("up_proj", w13[inter:]), ("down_proj", w2)):
            q, s = fb.quantize_weight_fp8_block(w)
            state[f"experts.{e}.{proj}.weight"] = q
            state[f"experts.{e}.{proj}.weight_scale_inv"] = s
    return state


def _moe_block(fp8_built: bool = False) -> MoE:
    config = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOP_K
    )
    return MoE.from_config(config, weight_block_size=(128, 128) if fp8_built else None)


@pytest.mark.parametrize("fp8_built", [False, True])
def test_loader_keeps_fp8_per_expert_weights(fp8_built: bool) -> None:
    src = _experts(E, H, INTER, seed=3)
    gate = torch.randn(E, H)
    state = _hf_fp8_state(src, gate)
    ours = _moe_block(fp8_built)
    ours.load_weights(state)  # learns block-FP8 from the arriving scales when built 16-bit
    ref = _experts(E, H, INTER, seed=3)
    ref.quantize_fp8_block_()
    exp = ours.experts
    assert exp.weight_block_size == (128, 128) and exp.gate_up_proj.dtype == fb.FP8_DTYPE
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(
            getattr(exp, name).view(torch.uint8), getattr(ref, name).view(torch.uint8)
        )
        assert torch.equal(getattr(exp, name + "_scale_inv"), getattr(ref, name + "_scale_inv"))
    x = torch.randn(5, H)
    weights, ids = ours.gate(x)
    torch.testing.assert_close(ours(x), ref(x, ids, weights))


def test_loader_stacked_fp8_layouts() -> None:
    ref = _experts(E, H, 128, seed=4)  # I a multiple of 128: release-granular scales
    ref.quantize_fp8_block_()
    stacked = {
        "gate.weight": torch.randn(E, H),
        "experts.gate_up_proj": ref.gate_up_proj.data,
        "experts.gate_up_proj_scale_inv": ref.gate_up_proj_scale_inv.data,
        "experts.down_proj": ref.down_proj.data,
        "experts.down_proj_scale_inv": ref.down_proj_scale_inv.data,
    }
    config = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=128, num_experts=E, num_experts_per_tok=TOP_K
    )
    for transposed in (False, True):
        state = dict(stacked)
        if transposed:  # Qwen3-VL-MoE's [E, in, out] stacks with their scales transposed too
            state = {
                k: v.transpose(1, 2).contiguous() if "experts" in k else v for k, v in state.items()
            }
        ours = MoE.from_config(config)
        ours.load_weights(state)
        assert torch.equal(
            ours.experts.gate_up_proj.view(torch.uint8), ref.gate_up_proj.view(torch.uint8)
        )
        assert torch.equal(ours.experts.down_proj_scale_inv, ref.down_proj_scale_inv)


def test_loader_errors_name_the_tensor() -> None:
    state = _hf_fp8_state(_experts(E, H, INTER), torch.randn(E, H))
    missing = {k: v for k, v in state.items() if k != "experts.2.up_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj\.weight is torch.float8_e4m3fn"):
        _moe_block().load_weights(missing)
    stray = dict(
        state, **{"experts.1.down_proj.weight": state["experts.1.down_proj.weight"].float()}
    )
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.weight has a scale_inv"):
        _moe_block().load_weights(stray)
    bad = dict(state, **{"experts.0.gate_proj.weight_scale_inv": torch.ones(2, 2)})
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight: weight_scale_inv"):
        _moe_block().load_weights(bad)
    stacked = {
        "gate.weight": state["gate.weight"],
        "experts.down_proj": torch.zeros(E, H, INTER).to(fb.FP8_DTYPE),
    }
    with pytest.raises(ValueError, match=r"experts\.down_proj is torch.float8_e4m3fn"):
        _moe_block().load_weights(stacked)
    # An FP8-built block given 16-bit experts: the scales are reported missing.
    sixteen = {k: v.float() for k, v in state.items() if not k.endswith("scale_inv")}
    with pytest.raises(ValueError, match="missing"):
        _moe_block(fp8_built=True).load_weights(sixteen)


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 8, 64, 256, 1024])
def test_gpu_qwen3_6_35b_a3b_experts(tokens: int) -> None:
    """Qwen3.6-35B-A3B's routed experts: H 2048, I 512, E 256, top-8."""
    num, hidden, inter, top_k = 256, 2048, 512, 8
    experts = MoEExperts(num, hidden, inter, dtype=torch.bfloat16).cuda()
    torch.manual_seed(0)
    experts.gate_up_proj.normal_(0, 0.02)
    experts.down_proj.normal_(0, 0.02)
    experts.quantize_fp8_block_()
    weights, ids = softmax_topk(torch.randn(tokens, num, device="cuda"), top_k)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    got = experts(x, ids, weights.bfloat16())
    sc = experts.block_scales()
    want = fused_moe_ref(
        x.float(), experts.gate_up_proj, experts.down_proj, ids, weights, scales=sc
    )
    assert _rel(got, want) < 3e-2
    graph_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    experts(graph_x, ids, weights.bfloat16())  # warm-up compiles outside the capture
    with torch.cuda.graph(graph):
        out = experts(graph_x, ids, weights.bfloat16())
    graph_x.copy_(x.flip(0))
    graph.replay()
    torch.testing.assert_close(out, experts(x.flip(0), ids, weights.bfloat16()))
