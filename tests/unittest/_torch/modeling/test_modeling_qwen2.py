"""Qwen2ForCausalLM parity with HF transformers: prefill, chunked prefill, mixed batches and
decode through the paged KV cache; plus the Qwen2-VL text stack with mRoPE positions."""

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

from tensorrt_llm._torch.models.modeling_qwen2 import Qwen2ForCausalLM, Qwen2TextForCausalLM
from tensorrt_llm._torch.models.modeling_utils import MODEL_CLASS_MAPPING, ModelConfig
from tensorrt_llm._torch.modules.rotary_embedding import MRotaryEmbedding
from tensorrt_llm._torch.weight_loading import build_model_on_meta

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
PROMPTS = [7, 5, 11]
NUM_DECODE = 8


def hf_reference_logits(hf: torch.nn.Module, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(input_ids=s[None]).logits[0] for s in sequences]


def check_schedule(ours, hf_logits, sequences, manager, positions=None) -> None:
    schedule = chunked_schedule(PROMPTS, chunked=2, num_decode=NUM_DECODE)
    assert_schedule_parity(ours, manager, sequences, schedule, hf_logits, positions)


def make_manager(config, dtype=torch.float32) -> FakeKVCacheManager:
    head_dim = config.hidden_size // config.num_attention_heads
    return FakeKVCacheManager(
        config.num_hidden_layers, 32, 4, config.num_key_value_heads, head_dim, dtype
    )


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_parity_prefill_chunked_decode(tie: bool) -> None:
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=tie)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    randomize_(hf, seed=1)
    ours = build_model_on_meta(Qwen2ForCausalLM, ModelConfig(pretrained_config=config), "cpu")
    state = hf.state_dict()
    if tie:
        state.pop("lm_head.weight", None)
    ours.load_weights(state)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie

    gen = torch.Generator().manual_seed(2)
    sequences = [
        torch.randint(0, TINY["vocab_size"], (n + NUM_DECODE + 1,), generator=gen) for n in PROMPTS
    ]
    check_schedule(ours, hf_reference_logits(hf, sequences), sequences, make_manager(config))


def test_qwen2_context_logits_without_cache() -> None:
    config = transformers.Qwen2Config(**TINY)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    randomize_(hf, seed=3)
    ours = build_model_on_meta(Qwen2ForCausalLM, ModelConfig(pretrained_config=config), "cpu")
    ours.load_weights(hf.state_dict())
    seqs = [torch.arange(6) + 3, torch.arange(9) % 7]
    md = build_metadata(None, [(0, 6, 0), (1, 9, 0)])
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(6), torch.arange(9)])[None]
    with torch.no_grad():
        got = ours(md, input_ids=ids, position_ids=pos, return_context_logits=True)
    expected = torch.cat(hf_reference_logits(hf, seqs))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_registered() -> None:
    assert MODEL_CLASS_MAPPING["Qwen2ForCausalLM"] is Qwen2ForCausalLM


def test_qwen2_vl_text_stack_mrope_parity() -> None:
    """The Qwen2-VL text config yields mRoPE (contiguous sections); hidden states match HF's
    Qwen2VLTextModel fed 3-axis positions, through chunked prefill and decode."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

    config = transformers.Qwen2VLConfig(
        text_config=dict(
            **TINY,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
        ),
    ).text_config
    hf = Qwen2VLTextModel(config).eval()
    randomize_(hf, seed=4)
    lm_head = torch.randn(TINY["vocab_size"], TINY["hidden_size"]) * 0.15
    ours = Qwen2TextForCausalLM(config, tie_word_embeddings=False)
    assert isinstance(ours.model.rotary_emb, MRotaryEmbedding)
    assert not ours.model.rotary_emb.interleaved
    weights = {f"model.{k}": v for k, v in hf.state_dict().items()}
    ours.load_weights({**weights, "lm_head.weight": lm_head})

    gen = torch.Generator().manual_seed(5)
    sequences, positions, hf_logits = [], [], []
    for n in PROMPTS:
        length = n + NUM_DECODE + 1
        seq = torch.randint(0, TINY["vocab_size"], (length,), generator=gen)
        # distinct T/H/W positions, like a vision block followed by text
        pos = torch.stack(
            [torch.arange(length), torch.arange(length) // 2, length - torch.arange(length)]
        )
        with torch.no_grad():
            hidden = hf(input_ids=seq[None], position_ids=pos[:, None]).last_hidden_state[0]
        sequences.append(seq)
        positions.append(pos)
        hf_logits.append(hidden @ lm_head.T)
    check_schedule(ours, hf_logits, sequences, make_manager(config), positions)
