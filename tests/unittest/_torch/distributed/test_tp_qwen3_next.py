"""Tensor parallelism of Qwen3-Next checkpoints on 2 gloo ranks. Their DeltaNet projections
come grouped per key head (`in_proj_qkvz`: [q_g | k_g | v_g | z_g] per group g, `in_proj_ba`:
[b_g | a_g]); a rank holds whole groups, reads only their rows (`RowGather` under the
Qwen3.5 layout's shards) and regroups them locally. Each rank's DeltaNet weights equal its
slice of the TP=1 model's regrouped ones; every step's logits of a chunked-prefill + decode
schedule equal TP=1's (float32), and so do greedy tokens through `LLM`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tp_bodies import schedule_logits_all
from tp_harness import spawn_ranks

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.checkpoint_slices import RowGather
from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.modules.gated_delta_net_weights import (
    convert_qwen3_next_gdn_weights,
    gdn_rank_shards,
)
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

WORLD = 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 key / 8 value DeltaNet heads (dk 16, dv 8): two key-head groups a rank.
    return write_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("next") / "qwen3_next")


def _load(ckpt: Path, mapping: Mapping | None = None) -> Any:
    config = load_pretrained_config(ckpt)
    model_config = ModelConfig(config, checkpoint_dir=str(ckpt))
    if mapping is not None:
        model_config = ModelConfig(config, checkpoint_dir=str(ckpt), mapping=mapping)
    return load_model(get_model_class(config.tllm_architecture), model_config, "cpu")


def _rank_rows(whole: torch.Tensor, shards: tuple[Any, ...]) -> torch.Tensor:
    """This rank's rows of a TP=1 fused weight whose parts are laid out back to back."""
    return torch.cat([s.take(part) for s, part in shards])


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_deltanet_weights_are_its_slice_of_tp1(rank: int, ckpt: Path) -> None:
    single = _load(ckpt)
    sharded = _load(ckpt, Mapping(world_size=WORLD, rank=rank, tp_size=WORLD))
    for layer, whole in zip(sharded.model.layers, single.model.layers, strict=True):
        if not hasattr(layer, "linear_attn"):
            continue
        gdn, ref = layer.linear_attn, whole.linear_attn
        assert (gdn.num_k_heads, gdn.num_v_heads) == (2, 4)
        tp = gdn_rank_shards(4, 8, 16, 8, Mapping(world_size=WORLD, rank=rank, tp_size=WORLD))
        assert tp is not None
        qkv, z = ref.in_proj_qkvz.weight.split([ref.conv_dim, ref.value_dim])
        b, a = ref.in_proj_ba.weight.chunk(2)
        same = dict(rtol=0, atol=0)
        torch.testing.assert_close(
            gdn.in_proj_qkvz.weight, _rank_rows(ref, ((tp.qkv, qkv), (tp.z, z))), **same
        )
        torch.testing.assert_close(
            gdn.in_proj_ba.weight, _rank_rows(ref, ((tp.heads, b), (tp.heads, a))), **same
        )
        torch.testing.assert_close(gdn.conv1d.weight, tp.qkv.take(ref.conv1d.weight), **same)
        for name in ("dt_bias", "A_log"):
            torch.testing.assert_close(getattr(gdn, name), tp.heads.take(getattr(ref, name)))
        torch.testing.assert_close(gdn.out_proj.weight, ref.out_proj.weight.chunk(2, 1)[rank])


class _Recording:
    """A stand-in for a lazy checkpoint tensor that records the rows each read asks for."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape, self.dtype = tensor, tensor.shape, tensor.dtype
        self.reads: list[tuple[int, int]] = []

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows = index[0] if isinstance(index, tuple) else index
        self.reads.append((rows.start, rows.stop))
        return self.tensor[index]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_reads_only_its_key_head_groups(rank: int) -> None:
    """The grouped rows of a rank's shard of the regrouped layout lie in its groups only,
    and they equal the whole regroup's slice."""
    k, v, dk, dv = 4, 8, 16, 8
    group = 2 * dk + 2 * (v // k) * dv
    grouped = torch.randn(k * group, 6)
    lazy = _Recording(grouped)
    views = convert_qwen3_next_gdn_weights(
        {"in_proj_qkvz.weight": lazy}, num_k_heads=k, num_v_heads=v, head_k_dim=dk, head_v_dim=dv
    )
    whole = convert_qwen3_next_gdn_weights(
        {"in_proj_qkvz.weight": grouped}, num_k_heads=k, num_v_heads=v, head_k_dim=dk, head_v_dim=dv
    )
    assert all(isinstance(t, RowGather) for t in views.values())
    tp = gdn_rank_shards(k, v, dk, dv, Mapping(world_size=WORLD, rank=rank, tp_size=WORLD))
    assert tp is not None
    qkv = tp.qkv.take(views["in_proj_qkv.weight"])
    z = tp.z.take(views["in_proj_z.weight"])
    assert torch.equal(qkv, tp.qkv.take(whole["in_proj_qkv.weight"]))
    assert torch.equal(z, tp.z.take(whole["in_proj_z.weight"]))
    own = range(rank * 2 * group, (rank + 1) * 2 * group)  # its two groups' rows
    assert lazy.reads and all(lo in own and hi - 1 in own for lo, hi in lazy.reads)
    assert sum(hi - lo for lo, hi in lazy.reads) == 2 * group  # each row read once


def test_tp2_qwen3_next_logits_equal_tp1(ckpt: Path) -> None:
    (r0,), (r1,) = spawn_ranks(schedule_logits_all, WORLD, [str(ckpt)])
    for rank, result in enumerate((r0, r1)):
        assert result["heads"] == (2, 1), f"rank {rank}"
        assert result["gdn_heads"] == [(2, 4)] * 3, f"rank {rank}"
        pairs = zip(result["reference"], result["sharded"], strict=True)
        for step, (ref, got) in enumerate(pairs):
            msg = f"rank {rank} step {step}"
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5, msg=msg)
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), msg


def test_llm_tp2_qwen3_next_greedy_equals_tp1(ckpt: Path) -> None:
    kwargs = dict(device="cpu", max_batch_size=2, max_num_tokens=16)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["hello there, how are you", "a much longer prompt " * 4, "short"]
    with LLM(str(ckpt), **kwargs) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    with LLM(str(ckpt), tensor_parallel_size=WORLD, **kwargs) as llm:
        sharded = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert all(len(tokens) == 6 for tokens in reference)
    assert sharded == reference
