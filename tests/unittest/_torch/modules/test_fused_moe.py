"""Top-k routing and the sparse MoE block: HF parity for Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE
and Qwen3-Next, every checkpoint layout of the expert weights, and the graph-safe path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

from tensorrt_llm._torch.modules.fused_moe import (
    MoE,
    convert_hf_expert_weights,
    fused_moe_dense_ref,
    fused_moe_ref,
    softmax_topk,
)
from tensorrt_llm._torch.modules.fused_moe.router import ROW_ALIGN
from tensorrt_llm._torch.modules.fused_moe.shared_fusion import why_not_fusable

# hidden != 2 * intermediate, so the transposed hub layout is unambiguous
SIZES = dict(hidden_size=16, moe_intermediate_size=12, num_experts=8, num_experts_per_tok=3)
Block = tuple[torch.nn.Module, MoE]


def _hf_block(
    kind: str, norm_topk_prob: bool = True, shared: int = 20
) -> tuple[torch.nn.Module, object]:
    if kind == "qwen3_moe":
        config: object = Qwen3MoeConfig(**SIZES, norm_topk_prob=norm_topk_prob)
        block: torch.nn.Module = Qwen3MoeSparseMoeBlock(config)
    elif kind == "qwen3_vl_moe":
        config = Qwen3VLMoeTextConfig(**SIZES)
        block = Qwen3VLMoeTextSparseMoeBlock(config)
    elif kind == "qwen3_5_moe":
        config = Qwen3_5MoeTextConfig(**SIZES, shared_expert_intermediate_size=shared)
        block = Qwen3_5MoeSparseMoeBlock(config)
    else:
        config = Qwen3NextConfig(**SIZES, shared_expert_intermediate_size=shared)
        block = Qwen3NextSparseMoeBlock(config)
    config._experts_implementation = "eager"  # type: ignore[attr-defined]
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return block.eval(), config


def _per_expert(state: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """The hub layout: experts.N.{gate,up,down}_proj.weight."""
    out = {k: v for k, v in state.items() if not k.startswith("experts.")}
    for e, (gate_up, down) in enumerate(
        zip(state["experts.gate_up_proj"], state["experts.down_proj"], strict=True)
    ):
        out[f"experts.{e}.gate_proj.weight"] = gate_up[:inter]
        out[f"experts.{e}.up_proj.weight"] = gate_up[inter:]
        out[f"experts.{e}.down_proj.weight"] = down
    return out


def _transposed(state: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """Qwen3-VL-MoE's hub layout: stacks of [E, H, 2I] and [E, I, H]."""
    out = dict(state)
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        out[name] = state[name].transpose(1, 2).contiguous()
    return out


LAYOUTS: dict[str, Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]]] = {
    "stacked": lambda state, inter: dict(state),
    "per_expert": _per_expert,
    "transposed": _transposed,
}


@torch.no_grad()
@pytest.mark.parametrize(
    "kind,norm",
    [
        ("qwen3_moe", True),
        ("qwen3_moe", False),
        ("qwen3_vl_moe", True),
        ("qwen3_5_moe", True),
        ("qwen3_next", True),
    ],
)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_matches_hf(kind: str, norm: bool, layout: str) -> None:
    torch.manual_seed(0)
    hf, config = _hf_block(kind, norm)
    ours = MoE.from_config(config).eval()
    assert ours.gate.renormalize == norm
    assert (ours.shared_expert is not None) == (kind in ("qwen3_5_moe", "qwen3_next"))
    ours.load_weights(LAYOUTS[layout](hf.state_dict(), SIZES["moe_intermediate_size"]))
    x = torch.randn(2, 11, SIZES["hidden_size"])
    torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours(x[0]), hf(x[:1])[0], atol=1e-5, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_shared_expert_matches_hf(kind: str, layout: str) -> None:
    """A shared expert as wide as the routed ones runs as routed expert E (shared_fusion.py)."""
    torch.manual_seed(0)
    inter = SIZES["moe_intermediate_size"]
    hf, config = _hf_block(kind, shared=inter)
    ours = MoE.from_config(config).eval()
    ours.load_weights(LAYOUTS[layout](hf.state_dict(), inter))
    assert ours.shared_fused and ours.shared_expert is None and ours.shared_expert_gate is None
    assert ours.experts.gate_up_proj.shape[0] == SIZES["num_experts"] + 1
    # Row E is the shared expert's gate; zero rows pad to ROW_ALIGN (a fast cuBLAS kernel).
    rows = SIZES["num_experts"] + 1
    assert ours.gate.num_logits == rows
    assert ours.gate.weight.shape[0] == -(-rows // ROW_ALIGN) * ROW_ALIGN > rows
    assert not ours.gate.weight[rows:].any()
    assert torch.equal(ours.gate.weight[rows - 1], hf.shared_expert_gate.weight[0])
    x = torch.randn(2, 11, SIZES["hidden_size"])
    torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-4)
    weights, ids = ours.gate(x.reshape(-1, SIZES["hidden_size"]))
    assert ids.shape[1] == SIZES["num_experts_per_tok"] + 1
    assert bool((ids[:, -1] == SIZES["num_experts"]).all())
    gate = torch.sigmoid(x.reshape(-1, SIZES["hidden_size"]) @ hf.shared_expert_gate.weight.T)
    torch.testing.assert_close(weights[:, -1:], gate)
    with pytest.raises(ValueError, match="load, then fuse"):
        ours.load_weights(hf.state_dict())
    assert not ours.fuse_shared_expert_()  # idempotent


def test_shared_expert_stays_separate_when_wider_or_precisions_differ() -> None:
    hf, config = _hf_block("qwen3_next")  # shared 20 != routed 12
    ours = MoE.from_config(config)
    ours.load_weights(hf.state_dict())
    assert not ours.shared_fused and ours.shared_expert is not None
    assert "shared_expert_intermediate_size 20" in str(why_not_fusable(ours))
    _, config = _hf_block("qwen3_next", shared=SIZES["moe_intermediate_size"])
    fp8_routed = MoE.from_config(config, weight_block_size=(16, 16))
    assert why_not_fusable(fp8_routed) == "16-bit shared expert with block-FP8 routed experts"
    fp8_shared = MoE.from_config(config)
    fp8_shared.shared_expert.gate_up_proj.to_fp8_block_((16, 16))
    assert why_not_fusable(fp8_shared) == "block-FP8 shared expert with 16-bit routed experts"


@torch.no_grad()
def test_fused_shared_expert_block_fp8() -> None:
    """Both block-FP8 (a -FP8 release): the scales are stacked too; the output is unchanged."""
    torch.manual_seed(0)
    inter, block = SIZES["moe_intermediate_size"], (16, 16)
    hf, config = _hf_block("qwen3_5_moe", shared=inter)
    ours = MoE.from_config(config).eval()
    assert ours.shared_expert is not None
    for linear in (ours.shared_expert.gate_up_proj, ours.shared_expert.down_proj):
        linear.to_fp8_block_(block, quantize_on_load=True)
    ours.load_weights(hf.state_dict())
    assert not ours.shared_fused  # the experts are still 16-bit here
    ours.experts.quantize_fp8_block_(block)
    x = torch.randn(13, SIZES["hidden_size"])
    want = ours(x)
    assert ours.fuse_shared_expert_()
    assert ours.experts.gate_up_proj_scale_inv.shape[0] == SIZES["num_experts"] + 1
    torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)
    # and near the 16-bit HF block (FP8 rounding of weights and activations)
    hf_out = hf(x[None])[0]
    assert float((ours(x) - hf_out).norm() / hf_out.norm()) < 0.1


def test_softmax_topk() -> None:
    logits = torch.randn(6, 8)
    weights, ids = softmax_topk(logits, 3, renormalize=False)
    probs = logits.softmax(-1)
    torch.testing.assert_close(weights, probs.gather(1, ids))
    assert (ids == logits.topk(3).indices).all()
    renorm, renorm_ids = softmax_topk(logits, 3, renormalize=True)
    assert (renorm_ids == ids).all()
    # Renormalising equals a softmax over the k chosen logits.
    torch.testing.assert_close(renorm, logits.gather(1, ids).softmax(-1))
    half, _ = softmax_topk(logits.half(), 3)
    assert half.dtype == torch.float16
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(logits, 9)


def test_dense_path_equals_sorted_path() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 16, generator=gen)
    gate_up = torch.randn(8, 24, 16, generator=gen)
    down = torch.randn(8, 16, 12, generator=gen)
    weights, ids = softmax_topk(torch.randn(9, 8, generator=gen), 3)
    sorted_out = fused_moe_ref(x, gate_up, down, ids, weights)
    dense_out = fused_moe_dense_ref(x, gate_up, down, ids, weights)
    torch.testing.assert_close(dense_out, sorted_out, atol=1e-4, rtol=1e-5)
    # Brute force: every (token, k) pair on its own.
    want = torch.zeros_like(x)
    for t in range(9):
        for j in range(3):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(sorted_out, want, atol=1e-4, rtol=1e-5)


def test_convert_keeps_other_weights_and_prefixes() -> None:
    state = {
        f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.full(
            (4, 2) if p != "down_proj" else (2, 4), float(e)
        )
        for e in range(2)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    state["model.layers.0.mlp.gate.weight"] = torch.zeros(2, 2)
    state["model.layers.0.mlp.shared_experts.0.gate_proj.weight"] = torch.zeros(1)
    out = convert_hf_expert_weights(state, num_experts=2, hidden_size=2, intermediate_size=4)
    assert set(out) == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.shared_experts.0.gate_proj.weight",
    }
    gate_up = out["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (2, 8, 2) and (gate_up[1] == 1).all() and (gate_up[0] == 0).all()


def test_bad_expert_weights_raise() -> None:
    hf, config = _hf_block("qwen3_moe")
    state = _per_expert(hf.state_dict(), SIZES["moe_intermediate_size"])
    ours = MoE.from_config(config)
    missing = {k: v for k, v in state.items() if k != "experts.5.up_proj.weight"}
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj"):
        ours.load_weights(missing)
    extra = dict(state, **{"experts.8.up_proj.weight": state["experts.0.up_proj.weight"]})
    with pytest.raises(ValueError, match=r"extra experts \[8\]"):
        ours.load_weights(extra)
    bad = dict(hf.state_dict(), **{"experts.down_proj": torch.zeros(8, 5, 5)})
    with pytest.raises(ValueError, match="expected"):
        ours.load_weights(bad)
    both = dict(state, **{"experts.down_proj": hf.state_dict()["experts.down_proj"]})
    with pytest.raises(ValueError, match="both per-expert and stacked"):
        ours.load_weights(both)
    with pytest.raises(ValueError, match="last dim"):
        ours(torch.zeros(3, 5))


@pytest.mark.gpu
@torch.no_grad()
def test_moe_on_cuda_and_under_graph_capture() -> None:
    torch.manual_seed(0)
    hf, config = _hf_block("qwen3_5_moe")
    ours = MoE.from_config(config)
    ours.load_weights(hf.state_dict())
    x = torch.randn(7, SIZES["hidden_size"])
    want = ours(x)
    ours.cuda()
    x_d = x.cuda()
    torch.testing.assert_close(ours(x_d).cpu(), want, atol=1e-4, rtol=1e-4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ours(x_d)  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ours(x_d)
    x_d.copy_(x.flip(0).cuda())
    graph.replay()
    torch.testing.assert_close(out.cpu(), ours(x.flip(0).cuda()).cpu(), atol=1e-4, rtol=1e-4)
