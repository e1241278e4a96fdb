"""Qwen3-Next (`Qwen3NextForCausalLM`): the tiny checkpoint's logits over a chunked-prefill +
decode schedule equal transformers' Qwen3NextForCausalLM on the same weights (the grouped
DeltaNet projections regrouped, 1-D partial RoPE, MoE with a gated shared expert), and the
settings whose layers the stack does not build are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from paged_kv_helpers import FakeKVCacheManager, assert_schedule_parity, chunked_schedule

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_qwen3_5 import check_qwen3_next_config
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

PROMPTS = [7, 5, 11]
NUM_DECODE = 4


def test_schedule_logits_match_hf(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3_next", tmp_path / "next")
    config = load_pretrained_config(ckpt)
    assert config.tllm_architecture == "Qwen3NextForCausalLM"
    model = load_model(
        get_model_class(config.tllm_architecture),
        ModelConfig(config, checkpoint_dir=str(ckpt), max_num_seq_slots=4),
        "cpu",
    )
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    sequences = [
        torch.randint(0, config.vocab_size, (n + NUM_DECODE + 1,), generator=gen) for n in PROMPTS
    ]
    with torch.no_grad():
        reference = [hf(input_ids=s[None]).logits[0] for s in sequences]
    attn = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
    manager = FakeKVCacheManager(config.num_hidden_layers, 32, 4, attn.num_kv_heads, attn.head_dim)
    schedule = chunked_schedule(PROMPTS, chunked=2, num_decode=NUM_DECODE)
    assert_schedule_parity(model, manager, sequences, schedule, reference, atol=2e-4)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"mlp_only_layers": [1]}, "mlp_only_layers=\\[1\\]"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"num_experts": 0}, "num_experts=0"),
    ],
)
def test_dense_layer_settings_are_refused(override: dict, match: str) -> None:
    config = transformers.Qwen3NextConfig(num_hidden_layers=4, **override)
    with pytest.raises(ValueError, match=match):
        check_qwen3_next_config(config)


def test_block_fp8_grouped_scales_are_refused() -> None:
    """Block-FP8 Qwen3-Next scales cover blocks of the grouped rows, which the regroup does
    not move: a clear error instead of an "unexpected weights" one."""
    from tensorrt_llm._torch.modules.gated_delta_net_weights import (
        convert_qwen3_next_gdn_weights,
    )

    weights = {"model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv": torch.ones(2, 1)}
    with pytest.raises(ValueError, match="block-FP8 Qwen3-Next"):
        convert_qwen3_next_gdn_weights(
            weights, num_k_heads=4, num_v_heads=8, head_k_dim=16, head_v_dim=8
        )
