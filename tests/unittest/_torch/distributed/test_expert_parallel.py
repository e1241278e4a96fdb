"""Expert parallelism pieces: each rank's experts from both checkpoint layouts, and the
routing onto them, checked against the full MoE block summed over ranks (no process group:
the sum stands in for the all-reduce)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.modules.fused_moe import MoE, convert_hf_expert_weights
from tensorrt_llm._torch.modules.fused_moe.expert_parallel import (
    expert_range,
    local_routing,
    select_local_experts,
)
from tensorrt_llm.mapping import Mapping

E, H, INTER = 4, 16, 8


def _per_expert(gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {"gate.weight": torch.randn(E, H, generator=gen)}
    for e in range(E):
        out[f"experts.{e}.gate_proj.weight"] = torch.randn(INTER, H, generator=gen)
        out[f"experts.{e}.up_proj.weight"] = torch.randn(INTER, H, generator=gen)
        out[f"experts.{e}.down_proj.weight"] = torch.randn(H, INTER, generator=gen)
    return out


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_ranks_sum_to_the_full_block(layout: str) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = _per_expert(gen)
    if layout == "stacked":
        weights = convert_hf_expert_weights(
            weights, num_experts=E, hidden_size=H, intermediate_size=INTER
        )
    full = MoE(E, 2, H, INTER)
    full.load_weights(weights)
    x = torch.randn(5, H, generator=gen)
    want = full(x)
    total = torch.zeros_like(want)
    for rank in range(2):
        mapping = Mapping(world_size=2, rank=rank, tp_size=2)
        start, count = expert_range(E, mapping)
        assert (start, count) == (2 * rank, 2)
        local = select_local_experts(weights, E, mapping)
        shard = MoE(E, 2, H, INTER, mapping=mapping)
        assert shard.experts.num_experts == 2
        shard.load_weights(local)
        topk_weights, topk_ids = shard.gate(x)
        ids, w = local_routing(topk_ids, topk_weights, start, count)
        # Pairs of the other rank's experts carry the dropped id `count`, never computed.
        elsewhere = (topk_ids < start) | (topk_ids >= start + count)
        assert bool((ids[elsewhere] == count).all()) and bool(elsewhere.any())
        assert bool(((ids >= 0) & (ids < count))[~elsewhere].all())
        total += shard.experts(x, ids, w, dropped=True)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_expert_counts_must_split() -> None:
    with pytest.raises(ValueError, match="num_experts=3 is not divisible"):
        expert_range(3, Mapping(world_size=2, rank=0, tp_size=2))
    with pytest.raises(ValueError, match="moe_expert_parallel_size=1 must equal"):
        expert_range(4, Mapping(world_size=2, rank=0, tp_size=2, moe_ep_size=1))


def test_forward_partial_needs_a_bias_free_row_layer() -> None:
    """The shared expert's pre-reduce partial: only a ROW layer has one, and only without a
    bias (which must join the reduced sum once)."""
    from tensorrt_llm._torch.modules.gated_mlp import GatedMLP

    mapping = Mapping(world_size=2, rank=1, tp_size=2)
    mlp = GatedMLP(H, INTER, mapping=mapping)
    assert mlp.down_proj.in_features == INTER // 2
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(3, H)
    gate, up = (x @ mlp.gate_up_proj.weight.T).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp.forward_partial(x), want)
    with pytest.raises(ValueError, match="not a tensor-parallel ROW"):
        mlp.gate_up_proj.forward_partial(x)
    with pytest.raises(ValueError, match="with a bias"):
        GatedMLP(H, INTER, bias=True, mapping=mapping).down_proj.forward_partial(x)
