"""Qwen3.5 MTP weights: skipped with one log line by default, loaded into `Qwen3_5MTP` after
`with_mtp`, and the MTP forward (through our paged attention, prefill then decode)
against a plain reference of its definition built from transformers' Qwen3.5 layers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_kv_helpers import FakeKVCacheManager, build_metadata

from tensorrt_llm._torch.config_utils import load_pretrained_config, resolve_architecture
from tensorrt_llm._torch.models import modeling_qwen3_next
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_qwen3_5_mtp import mtp_logits, with_mtp
from tensorrt_llm._torch.models.modeling_qwen3_next import (
    Qwen3_5MoeTextForCausalLM,
    Qwen3_5TextForCausalLM,
)
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.models.qwen_vl_vision_inputs import split_vl_weights
from tensorrt_llm._torch.weight_loading import load_model, load_safetensors_checkpoint
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint
from tensorrt_llm.tools.tiny_mtp import HFStyleMTP

FAMILIES = ("qwen3_5", "qwen3_5_moe")
TEXT_LM = {"qwen3_5": Qwen3_5TextForCausalLM, "qwen3_5_moe": Qwen3_5MoeTextForCausalLM}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = Path(tmp_path_factory.mktemp("mtp"))
    out = {f: write_tiny_checkpoint(f, root / f, mtp_num_hidden_layers=1) for f in FAMILIES}
    out["qwen3_5-plain"] = write_tiny_checkpoint("qwen3_5", root / "plain")
    return out


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_safetensors_checkpoint(ckpt, progress=False)


def _text_lm(family: str, ckpt: Path) -> Any:
    """The text causal LM with its MTP head, loaded from the checkpoint's text weights."""
    text_config = load_pretrained_config(ckpt).text_config
    lm = with_mtp(TEXT_LM[family](text_config))
    lm.load_weights(split_vl_weights(_weights(ckpt))[0])
    return lm.eval().requires_grad_(False)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_tensors_are_skipped_with_one_log_line(
    family: str, ckpts: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = ckpts[family]
    num_mtp = sum(name.startswith("mtp.") for name in _weights(ckpt))
    assert num_mtp > 10
    config = load_pretrained_config(ckpt)
    cls = get_model_class(resolve_architecture(config))
    with caplog.at_level(logging.INFO, logger=modeling_qwen3_next.__name__):
        model = load_model(cls, ModelConfig(config, checkpoint_dir=str(ckpt)), "cpu")
    lines = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert lines == [
        f"skipping {num_mtp} MTP tensors (mtp.*): multi-token prediction is off (no "
        "speculative decoding)"
    ]
    assert model.llm.mtp is None
    assert not any(name.startswith("mtp") for name, _ in model.named_parameters())


def test_mtp_option_leaves_the_main_weights_unchanged(ckpts: dict[str, Path]) -> None:
    with_mtp, plain = _weights(ckpts["qwen3_5"]), _weights(ckpts["qwen3_5-plain"])
    assert set(with_mtp) - set(plain) == {n for n in with_mtp if n.startswith("mtp.")}
    assert all(torch.equal(plain[n], with_mtp[n]) for n in plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_on_the_tensors_land_in_the_module(family: str, ckpts: dict[str, Path]) -> None:
    weights = _weights(ckpts[family])
    lm = _text_lm(family, ckpts[family])
    assert lm.mtp is not None and len(lm.mtp.layers) == 1
    mtp = lm.mtp
    for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert torch.equal(getattr(mtp, name).weight, weights[f"mtp.{name}.weight"]), name
    attn = mtp.layers[0].self_attn
    qkv = [weights[f"mtp.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(qkv))
    assert torch.equal(attn.o_proj.weight, weights["mtp.layers.0.self_attn.o_proj.weight"])
    # Every element of every mtp.* tensor went somewhere (fused or stacked, nothing dropped).
    ours = sum(p.numel() for p in mtp.parameters())
    assert ours == sum(t.numel() for n, t in weights.items() if n.startswith("mtp."))
    # Its attention gets the KV layer after the main stack's one full-attention layer.
    assert attn.attn.layer_idx == 1


def test_mtp_on_needs_the_weights_and_the_config(ckpts: dict[str, Path]) -> None:
    ckpt = ckpts["qwen3_5"]
    text = split_vl_weights(_weights(ckpt))[0]
    lm = with_mtp(Qwen3_5TextForCausalLM(load_pretrained_config(ckpt).text_config))
    without = {n: t for n, t in text.items() if not n.startswith("mtp.")}
    with pytest.raises(ValueError, match=r"missing 15 weights: mtp\."):
        lm.load_weights(without)
    plain_config = load_pretrained_config(ckpts["qwen3_5-plain"]).text_config
    with pytest.raises(ValueError, match="declares no MTP layers"):
        with_mtp(Qwen3_5TextForCausalLM(plain_config))
    plain_lm = Qwen3_5TextForCausalLM(plain_config)
    md = build_metadata(None, [(0, 2, 0)])
    with pytest.raises(ValueError, match="without its MTP head"):
        ids, hidden = torch.zeros(2, dtype=torch.long), torch.zeros(2, 64)
        mtp_logits(plain_lm, md, ids, hidden, torch.arange(2))


def _reference_mtp(family: str, ckpt: Path) -> tuple[HFStyleMTP, Any]:
    """transformers' layers holding the checkpoint's mtp.* tensors, and its rotary module."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    text_config = load_pretrained_config(ckpt).text_config
    text_config._attn_implementation = "eager"
    ref = HFStyleMTP(text_config)
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in _weights(ckpt).items():
        if not name.startswith("mtp."):
            continue
        name = name[len("mtp.") :]
        if ".experts." in name:  # hub per-expert tensors -> HF's stacked [E, ...] parameters
            prefix, idx, proj, _ = name.rsplit(".", 3)
            key = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
            part = experts.setdefault(key, {})
            part[int(idx) * 2 + (proj == "up_proj")] = t
            continue
        state[name] = t
    for key, parts in experts.items():
        if key.endswith("down_proj"):
            state[key] = torch.stack([parts[i] for i in sorted(parts)])
        else:
            pairs = [torch.cat([parts[2 * e], parts[2 * e + 1]]) for e in range(len(parts) // 2)]
            state[key] = torch.stack(pairs)
    ref.load_state_dict(state, strict=True)
    return ref.eval(), Qwen3_5TextRotaryEmbedding(text_config)


@torch.no_grad()
def _reference_logits(
    ref: HFStyleMTP,
    rotary: Any,
    weights: dict[str, torch.Tensor],
    ids: torch.Tensor,
    hidden: torch.Tensor,
) -> torch.Tensor:
    """The MTP definition over a whole causal sequence, in plain torch around HF's layers."""
    embed = weights["model.language_model.embed_tokens.weight"][ids]
    x = ref.fc(torch.cat([ref.pre_fc_norm_embedding(embed), ref.pre_fc_norm_hidden(hidden)], -1))
    x = x[None]
    num_tokens = ids.shape[0]
    cos, sin = rotary(x, torch.arange(num_tokens)[None])
    mask = torch.full((num_tokens, num_tokens), float("-inf")).triu(1)[None, None]
    out = ref.layers[0](x, position_embeddings=(cos, sin), attention_mask=mask)
    out = out[0] if isinstance(out, tuple) else out
    return ref.norm(out)[0] @ weights["lm_head.weight"].T


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_forward_matches_reference(family: str, ckpts: dict[str, Path]) -> None:
    """Prefill 6 tokens then decode 4, each step's draft logits equal the reference's."""
    ckpt = ckpts[family]
    lm = _text_lm(family, ckpt)
    ref, rotary = _reference_mtp(family, ckpt)
    gen = torch.Generator().manual_seed(0)
    num_tokens, prefill = 10, 6
    ids = torch.randint(0, 512, (num_tokens,), generator=gen)
    hidden = torch.randn(num_tokens, 64, generator=gen)
    expected = _reference_logits(ref, rotary, _weights(ckpt), ids, hidden)
    text = lm.config
    # One KV layer for the main stack's full-attention layer, one for the MTP layer.
    manager = FakeKVCacheManager(2, 16, 4, text.num_key_value_heads, text.head_dim)
    steps = [((0, prefill, 0),)] + [((0, 1, c),) for c in range(prefill, num_tokens)]
    with torch.no_grad():
        for step in steps:
            (_, n, c) = step[0]
            md = build_metadata(manager, step)
            got = mtp_logits(lm, md, ids[c : c + n], hidden[c : c + n], torch.arange(c, c + n))
            torch.testing.assert_close(got, expected[c : c + n], atol=1e-4, rtol=0)
    # A second draft step wraps around to the one layer (step k uses layer k % num_layers).
    md = build_metadata(None, [(1, 3, 0)])
    again = mtp_logits(lm, md, ids[:3], hidden[:3], torch.arange(3), spec_step_idx=1)
    torch.testing.assert_close(again, expected[:3], atol=1e-4, rtol=0)
