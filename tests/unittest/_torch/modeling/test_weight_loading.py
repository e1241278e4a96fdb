"""Checkpoint loading: single and sharded safetensors, name mapping, clear errors, and the
meta-device build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from paged_kv_helpers import build_metadata, randomize_
from safetensors.torch import save_file
from torch import nn

from tensorrt_llm._torch.models.modeling_qwen2 import Qwen2ForCausalLM
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.weight_loading import (
    build_model_on_meta,
    check_weights,
    load_model,
    load_safetensors_checkpoint,
)

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def hf_model() -> transformers.Qwen2ForCausalLM:
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)).eval()
    randomize_(hf, seed=0)
    return hf


def _state(hf: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in hf.state_dict().items()}


def _write_sharded(folder: Path, state: dict[str, torch.Tensor], num_shards: int) -> None:
    names = sorted(state)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::num_shards]}
        save_file(part, str(folder / shard))
        weight_map.update({n: shard for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_single_and_sharded_loading_agree(tmp_path: Path, hf_model) -> None:
    state = _state(hf_model)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    save_file(state, str(single / "model.safetensors"))
    _write_sharded(sharded, state, num_shards=3)
    for folder in (single, sharded):
        loaded = load_safetensors_checkpoint(folder, progress=False)
        assert set(loaded) == set(state)
        assert all(torch.equal(loaded[n], state[n]) for n in state)

    config = ModelConfig(pretrained_config=hf_model.config, checkpoint_dir=str(sharded))
    ours = load_model(Qwen2ForCausalLM, config, "cpu")
    ids = torch.tensor([5, 9, 1, 33, 2])
    md = build_metadata(None, [(0, 5, 0)])
    with torch.no_grad():
        got = ours(md, input_ids=ids, position_ids=torch.arange(5)[None])
        expected = hf_model(input_ids=ids[None]).logits[0, -1:]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_sharded_index_errors(tmp_path: Path, hf_model) -> None:
    state = _state(hf_model)
    _write_sharded(tmp_path, state, num_shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = index["weight_map"]["model.norm.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"not in any shard: model\.extra\.weight"):
        load_safetensors_checkpoint(tmp_path, progress=False)
    index["weight_map"]["model.more.weight"] = "model-00009-of-00009.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shard files that are missing"):
        load_safetensors_checkpoint(tmp_path, progress=False)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_safetensors_checkpoint(tmp_path / "..", progress=False)


def test_missing_unexpected_and_shape_errors(hf_model) -> None:
    ours = build_model_on_meta(
        Qwen2ForCausalLM, ModelConfig(pretrained_config=hf_model.config), "cpu"
    )
    state = _state(hf_model)
    missing = dict(state)
    del missing["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"missing 1 weights: model\.layers\.1\.self_attn\.k_proj"):
        ours.load_weights(missing)
    extra = {**state, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected 1 weights: model\.layers\.9\.mlp\.up_proj"):
        ours.load_weights(extra)
    bad = {**state, "model.norm.weight": torch.zeros(7)}
    with pytest.raises(ValueError, match=r"shape mismatch for 'model\.norm\.weight'"):
        ours.load_weights(bad)
    # HF's stale rotary buffer is ignored, a rename hook maps other layouts
    renamed = {f"language_model.{k}": v for k, v in state.items()}
    renamed["language_model.model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    ours.load_weights(renamed, rename=lambda n: n.removeprefix("language_model."))


def test_check_weights_preview_counts() -> None:
    expected = {f"w{i}" for i in range(9)}
    with pytest.raises(
        ValueError, match=r"missing 8 weights: w1, w2, w3, w4, w5, \.\.\. \(3 more\)"
    ):
        check_weights(expected, {"w0", "x"})
    check_weights({"a", "b"}, {"a"}, optional={"b"})


def test_meta_build_materialises_and_keeps_ties(hf_model) -> None:
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    ours = build_model_on_meta(
        Qwen2ForCausalLM, ModelConfig(pretrained_config=config, torch_dtype=torch.bfloat16), "cpu"
    )
    assert not any(p.is_meta for p in ours.parameters())
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.model.norm.weight.dtype == torch.bfloat16
    assert ours.model.rotary_emb.cos_sin_table.dtype == torch.float32

    class MetaBuffer(nn.Module):
        def __init__(self, _config: object) -> None:
            super().__init__()
            self.register_buffer("table", torch.zeros(3))

    with pytest.raises(ValueError, match="meta device.*table"):
        build_model_on_meta(MetaBuffer, None, "cpu")
