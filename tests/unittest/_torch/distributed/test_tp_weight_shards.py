"""Each tensor-parallel rank loads exactly its slices of the checkpoint (no process group is
needed to build and load a shard: collectives run only in forward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tensorrt_llm._torch.checkpoint_slices import LazyTensor, lazy_safetensors_checkpoint
from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm._torch.distributed import TensorShard, kv_head_shard, vocab_shard
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


def _rows(t: torch.Tensor, rank: int, tp: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank]


@pytest.mark.parametrize("rank", [0, 1])
def test_qwen2_rank_holds_its_slices(rank: int, tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen2", tmp_path / "q2")
    full = load_file(str(ckpt / "model.safetensors"))
    config = load_pretrained_config(ckpt)
    mapping = Mapping(world_size=2, rank=rank, tp_size=2)
    cls = get_model_class(config.tllm_architecture)
    model = load_model(cls, ModelConfig(config, checkpoint_dir=str(ckpt), mapping=mapping), "cpu")
    layer = model.model.layers[1]
    pre = "model.layers.1."
    qkv = torch.cat(
        [_rows(full[f"{pre}self_attn.{p}_proj.weight"], rank, 2) for p in ("q", "k", "v")]
    )
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv, rtol=0, atol=0)
    qkv_bias = torch.cat(
        [_rows(full[f"{pre}self_attn.{p}_proj.bias"], rank, 2) for p in ("q", "k", "v")]
    )
    torch.testing.assert_close(layer.self_attn.qkv_proj.bias, qkv_bias, rtol=0, atol=0)
    o = _rows(full[f"{pre}self_attn.o_proj.weight"], rank, 2, dim=1)
    torch.testing.assert_close(layer.self_attn.o_proj.weight, o, rtol=0, atol=0)
    gate_up = torch.cat([_rows(full[f"{pre}mlp.{p}_proj.weight"], rank, 2) for p in ("gate", "up")])
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)
    down = _rows(full[f"{pre}mlp.down_proj.weight"], rank, 2, dim=1)
    torch.testing.assert_close(layer.mlp.down_proj.weight, down, rtol=0, atol=0)
    embed = _rows(full["model.embed_tokens.weight"], rank, 2)
    torch.testing.assert_close(model.model.embed_tokens.weight, embed, rtol=0, atol=0)
    # Norms are whole on every rank.
    norm = full[f"{pre}input_layernorm.weight"]
    torch.testing.assert_close(layer.input_layernorm.weight, norm, rtol=0, atol=0)


def test_lazy_slice_reads_the_same_rows(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "q3")
    full = load_file(str(ckpt / "model.safetensors"))
    lazy = lazy_safetensors_checkpoint([ckpt / "model.safetensors"])
    name = "model.layers.0.mlp.down_proj.weight"
    assert isinstance(lazy[name], LazyTensor)
    assert lazy[name].shape == full[name].shape and lazy[name].dtype == full[name].dtype
    cols = TensorShard(1, 32, 32)
    assert torch.equal(cols.take(lazy[name]), full[name][:, 32:64])
    assert torch.equal(lazy[name].materialize(), full[name])


def test_shard_arithmetic() -> None:
    # 2 kv heads over 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1.
    assert [kv_head_shard(2, 8, 4, r)[0].start for r in range(4)] == [0, 0, 8, 8]
    assert kv_head_shard(4, 8, 2, 1) == (TensorShard(0, 16, 16), 2)
    # 515 rows over 2 ranks: 258 each, the last holds 257 real rows and one zero row.
    last = vocab_shard(515, 2, 1)
    assert (last.start, last.length, last.size) == (258, 257, 258)
    padded = last.take(torch.ones(515, 3))
    assert padded.shape == (258, 3) and padded[-1].abs().sum() == 0
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        kv_head_shard(3, 8, 2, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must be a multiple"):
        kv_head_shard(3, 8, 4, 0)


def test_mapping_checks() -> None:
    assert Mapping().tp_size == 1 and not Mapping().has_tp
    m = Mapping(world_size=4, rank=3, tp_size=4)
    assert (m.tp_rank, m.moe_ep_size, m.tp_group) == (3, 4, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="world_size=2 must equal"):
        Mapping(world_size=2, tp_size=1)
    with pytest.raises(ValueError, match="pp_size=2"):
        Mapping(world_size=2, pp_size=2)
    with pytest.raises(ValueError, match="moe_ep_size=3"):
        Mapping(world_size=4, tp_size=4, moe_ep_size=3)


@pytest.mark.parametrize("rank", [0, 1])
def test_qwen3_5_rank_holds_its_deltanet_slices(rank: int, tmp_path: Path) -> None:
    """Key heads K/2 with their value heads V/2: in_proj_qkv rows and conv1d channels are
    this rank's q, k and v ranges joined; z, b, a, dt_bias, A_log by value head; out_proj by
    input column; the gated norm whole. The gated attention's q_proj rows (q and gate
    interleaved per head) split by head."""
    ckpt = write_tiny_checkpoint("qwen3_5", tmp_path / "q35")
    full = load_file(str(ckpt / "model.safetensors"))
    config = load_pretrained_config(ckpt)
    text = config.text_config
    mapping = Mapping(world_size=2, rank=rank, tp_size=2)
    cls = get_model_class(config.tllm_architecture)
    model = load_model(cls, ModelConfig(config, checkpoint_dir=str(ckpt), mapping=mapping), "cpu")
    lm = model.llm
    pre = "model.language_model.layers.0.linear_attn."
    gdn = lm.model.layers[0].linear_attn
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t.split([key_dim, key_dim, t.shape[0] - 2 * key_dim])
        return torch.cat([_rows(q, rank, 2), _rows(k, rank, 2), _rows(v, rank, 2)])

    def same(got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    z = _rows(full[pre + "in_proj_z.weight"], rank, 2)
    same(gdn.in_proj_qkvz.weight, torch.cat([qkv_rows(full[pre + "in_proj_qkv.weight"]), z]))
    ba = [_rows(full[f"{pre}in_proj_{p}.weight"], rank, 2) for p in ("b", "a")]
    same(gdn.in_proj_ba.weight, torch.cat(ba))
    same(gdn.conv1d.weight, qkv_rows(full[pre + "conv1d.weight"]))
    for name in ("dt_bias", "A_log"):
        same(getattr(gdn, name), _rows(full[pre + name], rank, 2))
    same(gdn.out_proj.weight, _rows(full[pre + "out_proj.weight"], rank, 2, dim=1))
    same(gdn.norm.weight, full[pre + "norm.weight"])
    assert gdn.conv_state_shape[0] == gdn.conv_dim == (2 * key_dim) // 2 + gdn.value_dim
    attn_idx = text.layer_types.index("full_attention")
    attn = lm.model.layers[attn_idx].self_attn
    q_gate = _rows(full[f"model.language_model.layers.{attn_idx}.self_attn.q_proj.weight"], rank, 2)
    same(attn.qkv_proj.weight[: q_gate.shape[0]], q_gate)


def test_multi_range_shard_and_uneven_deltanet_heads(tmp_path: Path) -> None:
    from tensorrt_llm._torch.distributed import MultiRangeShard
    from tensorrt_llm._torch.modules.gated_delta_net import GatedDeltaNet

    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "q3")
    full = load_file(str(ckpt / "model.safetensors"))
    lazy = lazy_safetensors_checkpoint([ckpt / "model.safetensors"])
    name = "model.layers.0.mlp.down_proj.weight"
    shard = MultiRangeShard(0, ((4, 2), (10, 3)))
    assert shard.length == shard.size == 5
    assert torch.equal(shard.take(lazy[name]), torch.cat([full[name][4:6], full[name][10:13]]))
    tp2 = Mapping(world_size=2, rank=0, tp_size=2)
    # V is a multiple of K, so key heads that split mean value heads that split.
    with pytest.raises(ValueError, match="linear_num_key_heads=3"):
        GatedDeltaNet(32, 3, 6, 8, 8, mapping=tp2)
