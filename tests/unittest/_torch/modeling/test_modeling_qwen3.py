"""Qwen3ForCausalLM parity with HF transformers through the paged KV cache, and the Qwen3-VL
text stack (interleaved mRoPE, deepstack) against HF's Qwen3VLTextModel."""

from __future__ import annotations

import pytest
import torch
import transformers
from paged_kv_helpers import (
    FakeKVCacheManager,
    assert_schedule_parity,
    build_metadata,
    chunked_schedule,
    randomize_,
)

from tensorrt_llm._torch.models.modeling_qwen3 import Qwen3ForCausalLM, Qwen3TextForCausalLM
from tensorrt_llm._torch.models.modeling_utils import MODEL_CLASS_MAPPING, ModelConfig
from tensorrt_llm._torch.modules.rotary_embedding import MRotaryEmbedding
from tensorrt_llm._torch.weight_loading import build_model_on_meta

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # Qwen3 decouples head_dim from hidden_size / heads
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
PROMPTS = [6, 9, 4]
NUM_DECODE = 8


def _sequences(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, TINY["vocab_size"], (n + NUM_DECODE + 1,), generator=gen) for n in PROMPTS
    ]


def _manager() -> FakeKVCacheManager:
    return FakeKVCacheManager(TINY["num_hidden_layers"], 40, 4, TINY["num_key_value_heads"], 32)


@pytest.mark.parametrize("attention_bias", [False, True])
def test_qwen3_parity_prefill_chunked_decode(attention_bias: bool) -> None:
    config = transformers.Qwen3Config(**TINY, attention_bias=attention_bias)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    randomize_(hf, seed=11)
    ours = build_model_on_meta(Qwen3ForCausalLM, ModelConfig(pretrained_config=config), "cpu")
    ours.load_weights(hf.state_dict())
    assert ours.model.layers[0].self_attn.q_norm is not None
    assert (ours.model.layers[0].self_attn.o_proj.bias is not None) == attention_bias

    sequences = _sequences(12)
    with torch.no_grad():
        reference = [hf(input_ids=s[None]).logits[0] for s in sequences]
    schedule = chunked_schedule(PROMPTS, chunked=1, num_decode=NUM_DECODE)
    assert_schedule_parity(ours, _manager(), sequences, schedule, reference)


def test_registered() -> None:
    assert MODEL_CLASS_MAPPING["Qwen3ForCausalLM"] is Qwen3ForCausalLM


def _qwen3_vl_text(seed: int):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]}
    config = transformers.Qwen3VLConfig(text_config=dict(**TINY, rope_parameters=rope)).text_config
    hf = Qwen3VLTextModel(config).eval()
    randomize_(hf, seed=seed)
    lm_head = torch.randn(TINY["vocab_size"], TINY["hidden_size"]) * 0.15
    ours = Qwen3TextForCausalLM(config, tie_word_embeddings=False)
    # the transformers-5 VL layout, mapped through the rename hook
    weights = {f"model.language_model.{k}": v for k, v in hf.state_dict().items()}
    weights["lm_head.weight"] = lm_head
    ours.load_weights(weights, rename=lambda n: n.replace("model.language_model.", "model."))
    return hf, ours, lm_head


def _mrope_positions(length: int) -> torch.Tensor:
    ar = torch.arange(length)
    return torch.stack([ar, ar // 3, (ar * 7) % length])


def test_qwen3_vl_text_stack_interleaved_mrope_parity() -> None:
    hf, ours, lm_head = _qwen3_vl_text(seed=13)
    rotary = ours.model.rotary_emb
    assert isinstance(rotary, MRotaryEmbedding) and rotary.interleaved
    sequences = _sequences(14)
    positions = [_mrope_positions(s.numel()) for s in sequences]
    with torch.no_grad():
        reference = [
            hf(input_ids=s[None], position_ids=p[:, None]).last_hidden_state[0] @ lm_head.T
            for s, p in zip(sequences, positions, strict=True)
        ]
    schedule = chunked_schedule(PROMPTS, chunked=0, num_decode=NUM_DECODE)
    assert_schedule_parity(ours, _manager(), sequences, schedule, reference, positions)


def test_qwen3_vl_deepstack_matches_hf() -> None:
    hf, ours, lm_head = _qwen3_vl_text(seed=15)
    sequences = [s[:n] for s, n in zip(_sequences(16), PROMPTS, strict=True)]
    positions = [_mrope_positions(n) for n in PROMPTS]
    gen = torch.Generator().manual_seed(17)
    masks = [torch.rand(n, generator=gen) < 0.5 for n in PROMPTS]
    num_deepstack = 2
    visual = [
        [torch.randn(int(m.sum()), TINY["hidden_size"], generator=gen) for _ in range(2)]
        for m in masks
    ]
    with torch.no_grad():
        reference = torch.cat(
            [
                hf(
                    input_ids=s[None],
                    position_ids=p[:, None],
                    visual_pos_masks=m[None],
                    deepstack_visual_embeds=v,
                ).last_hidden_state[0]
                @ lm_head.T
                for s, p, m, v in zip(sequences, positions, masks, visual, strict=True)
            ]
        )
    # ours: one [T, hidden] tensor per layer, zero on text rows
    deepstack = []
    for layer in range(num_deepstack):
        full = torch.zeros(sum(PROMPTS), TINY["hidden_size"])
        full[torch.cat(masks)] = torch.cat([v[layer] for v in visual])
        deepstack.append(full)
    md = build_metadata(_manager(), [(r, n, 0) for r, n in enumerate(PROMPTS)])
    with torch.no_grad():
        got = ours(
            md,
            input_ids=torch.cat(sequences),
            position_ids=torch.cat(positions, 1)[:, None],
            deepstack_embeds=deepstack,
            return_context_logits=True,
        )
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        plain = ours(
            md,
            input_ids=torch.cat(sequences),
            position_ids=torch.cat(positions, 1)[:, None],
            return_context_logits=True,
        )
    assert not torch.allclose(plain, reference, atol=1e-3)
