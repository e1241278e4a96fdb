"""Configs of the tiny random checkpoints (tiny_checkpoint.py writes them): one builder per
family, then the overrides a test may apply (sub-configs, YaRN rope scaling, MTP layers)."""

from __future__ import annotations

import copy
from typing import Any

from .tiny_mtp import MTP_FAMILIES
from .tiny_tokenizer import SPECIAL_IDS

TINY_FAMILIES: tuple[str, ...] = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen_image_bench",
    "qwen2",
    "qwen3",
    "qwen3_next",
)

VOCAB_SIZE = 512
HIDDEN = 64


def _text_base(**extra: Any) -> dict[str, Any]:
    ids = SPECIAL_IDS
    base: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        # Wider than the real 0.02 so tiny models give peaked logits and greedy parity is stable.
        "initializer_range": 0.05,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    base.update(extra)
    return base


def _mrope(section: list[int], theta: float, interleaved: bool, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta, "mrope_section": section}
    if interleaved:
        params["mrope_interleaved"] = True
    params.update(extra)
    return params


def _vision_v3(model_type: str, deepstack: bool) -> dict[str, Any]:
    """Qwen3-VL / Qwen3.5 vision tower: patch 16, learned 8x8 position grid."""
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": HIDDEN,
        "num_position_embeddings": 64,
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": 0.05,
    }
    if deepstack:
        cfg["deepstack_visual_indexes"] = [0]
    return cfg


def _qwen2_vl() -> dict[str, Any]:
    text = _text_base(model_type="qwen2_vl_text")
    text.pop("head_dim")  # Qwen2 derives it: 64 / 4 = 16, so the rotary half is 8 = 2+3+3.
    text["rope_parameters"] = _mrope([2, 3, 3], 1e6, interleaved=False)
    vision = {
        "model_type": "qwen2_vl_vision",
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": HIDDEN,
        "mlp_ratio": 2,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": 0.05,
    }
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "text_config": text,
        "vision_config": vision,
    }


def _qwen2_5_vl() -> dict[str, Any]:
    cfg = _qwen2_vl()
    cfg["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    cfg["model_type"] = "qwen2_5_vl"
    cfg["text_config"]["model_type"] = "qwen2_5_vl_text"
    cfg["vision_config"] = {
        "model_type": "qwen2_5_vl_vision",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        # 56 px = 2x2 merged units per window: block 0 is windowed, block 1 attends globally.
        "window_size": 56,
        "fullatt_block_indexes": [1],
        "out_hidden_size": HIDDEN,
        "hidden_act": "silu",
        "initializer_range": 0.05,
    }
    return cfg


def _qwen3_vl(moe: bool = False) -> dict[str, Any]:
    text = _text_base(model_type="qwen3_vl_moe_text" if moe else "qwen3_vl_text")
    # head_dim 16 -> rotary half 8, interleaved T,H,W sections like Qwen3-VL's [24,20,20].
    text["rope_parameters"] = _mrope([3, 3, 2], 5e6, interleaved=True)
    if moe:
        # moe_intermediate 48 keeps 2*I != hidden, so a transposed expert tensor cannot pass
        # a shape check by accident.
        text.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=[],
        )
    name = "Qwen3VLMoe" if moe else "Qwen3VL"
    return {
        "architectures": [f"{name}ForConditionalGeneration"],
        "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
        "text_config": text,
        "vision_config": _vision_v3("qwen3_vl_moe" if moe else "qwen3_vl", deepstack=True),
    }


def _qwen3_5(moe: bool = False, vision_model_type: str | None = None) -> dict[str, Any]:
    text = _text_base(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        num_hidden_layers=4,
        head_dim=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        attn_output_gate=True,
    )
    # head_dim 64 with partial rotary 0.25 -> rotary 16 -> half 8 = 3+3+2 (real: [11,11,10]).
    text["rope_parameters"] = _mrope([3, 3, 2], 1e7, interleaved=True, partial_rotary_factor=0.25)
    if moe:
        del text["intermediate_size"]
        text.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
        )
    base = "qwen3_5_moe" if moe else "qwen3_5"
    vtype = vision_model_type or f"{base}_vision"
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    return {
        "architectures": [f"{name}ForConditionalGeneration"],
        "model_type": base,
        "language_model_only": False,
        "text_config": text,
        "vision_config": _vision_v3(vtype, deepstack=False),
    }


def _qwen3_next() -> dict[str, Any]:
    """Qwen3-Next (text only, every layer MoE with a gated shared expert): 4 key / 8 value
    DeltaNet heads of unequal dims, so a tensor-parallel rank holds two whole key-head groups
    of the grouped `in_proj_qkvz` / `in_proj_ba` and a k/v mix-up changes shapes."""
    return _text_base(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        num_hidden_layers=4,
        head_dim=32,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        # 1-D RoPE on a quarter of each 32-dim head (the release: 0.25 of 256).
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )


def _text_llm(family: str) -> dict[str, Any]:
    if family == "qwen2":
        cfg = _text_base(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6)
        cfg.pop("head_dim")  # Qwen2 derives it from hidden / heads
        cfg.update(use_sliding_window=False, max_window_layers=2)
        return cfg
    return _text_base(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], rope_theta=1e6, attention_bias=False
    )


def build_config_dict(family: str, **overrides: Any) -> dict[str, Any]:
    """The config.json content for `family`, with `overrides` merged (see write_tiny_checkpoint)."""
    builders = {
        "qwen2_vl": _qwen2_vl,
        "qwen2_5_vl": _qwen2_5_vl,
        "qwen3_vl": lambda: _qwen3_vl(moe=False),
        "qwen3_vl_moe": lambda: _qwen3_vl(moe=True),
        "qwen3_5": lambda: _qwen3_5(moe=False),
        "qwen3_5_moe": lambda: _qwen3_5(moe=True),
        # Legacy image-bench layout: the vision sub-config keeps the old model_type "qwen3_5".
        "qwen_image_bench": lambda: _qwen3_5(moe=False, vision_model_type="qwen3_5"),
        "qwen2": lambda: _text_llm("qwen2"),
        "qwen3": lambda: _text_llm("qwen3"),
        "qwen3_next": _qwen3_next,
    }
    if family not in builders:
        raise ValueError(f"unknown tiny family {family!r}; expected one of {TINY_FAMILIES}")
    cfg = builders[family]()
    # Issue 16 hooks: YaRN (or any) rope scaling, and MTP layers for the Qwen3.5 families.
    _apply_rope_scaling(cfg, overrides.pop("rope_scaling", None))
    _apply_mtp_layers(family, cfg, overrides.pop("mtp_num_hidden_layers", None))
    if "vision_config" in cfg:
        ids = SPECIAL_IDS
        cfg.update(
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
    _apply_overrides(cfg, overrides)
    return cfg


def _apply_rope_scaling(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> None:
    """Merge `rope_scaling` into the text config's `rope_parameters` (transformers-5 layout,
    keeping mRoPE sections), or set legacy `rope_scaling` where the family has a top-level
    `rope_theta` (like the Qwen2/Qwen3 hub configs)."""
    if rope_scaling is None:
        return
    text = cfg.get("text_config", cfg)
    if "rope_parameters" in text:
        text["rope_parameters"].update(copy.deepcopy(rope_scaling))
    else:
        text["rope_scaling"] = copy.deepcopy(rope_scaling)


def _apply_mtp_layers(family: str, cfg: dict[str, Any], num_layers: int | None) -> None:
    """`mtp_num_hidden_layers` in the text config; `build_state_dict` then adds `mtp.*`."""
    if num_layers is None:
        return
    if family not in MTP_FAMILIES:
        raise ValueError(
            f"mtp_num_hidden_layers is for the families {MTP_FAMILIES}, not {family!r}"
        )
    cfg["text_config"]["mtp_num_hidden_layers"] = int(num_layers)


def _apply_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> None:
    """`text_config=`/`vision_config=` dicts merge into the sub-config; other keys set top level.

    `tie_word_embeddings` is mirrored into text_config because HF reads it from either place.
    """
    for key, value in overrides.items():
        if key in ("text_config", "vision_config"):
            if key not in cfg:
                raise ValueError(f"override {key!r} given for a family without a {key}")
            if not isinstance(value, dict):
                raise ValueError(f"override {key!r} must be a dict, got {type(value).__name__}")
            cfg[key].update(copy.deepcopy(value))
        else:
            cfg[key] = copy.deepcopy(value)
    if "tie_word_embeddings" in overrides and "text_config" in cfg:
        cfg["text_config"]["tie_word_embeddings"] = overrides["tie_word_embeddings"]
