"""Tiny random HF-format checkpoints for every Qwen(-VL) family, built locally in well under 1 s.

Tests, the demo and the benchmarks share this writer, so nobody needs hub access. Each folder holds
config.json, model.safetensors (hub layout), a locally trained byte-level BPE tokenizer with the
Qwen special tokens, a Qwen-style chat template, and the image/video processor configs.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .tiny_mtp import MTP_FAMILIES, mtp_state_dict
from .tiny_tokenizer import (  # noqa: F401  (re-exported: tests and tools import them here)
    BPE_VOCAB_SIZE,
    CHAT_TEMPLATE,
    SPECIAL_IDS,
    SPECIAL_TOKENS,
    build_tokenizer,
    write_processing_files,
)

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
)

VOCAB_SIZE = 512
HIDDEN = 64
_DEMO_VERSION = "v1"
# NOTE: every file get_or_build_demo_checkpoint requires before it trusts a cached folder.
REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
_VL_FILES: tuple[str, ...] = ("preprocessor_config.json", "video_preprocessor_config.json")


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


def _hf_model_class(architecture: str) -> type:
    import transformers

    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {architecture}")
    return cls


def _hf_config(cfg: dict[str, Any]) -> Any:
    from transformers import CONFIG_MAPPING

    kwargs = copy.deepcopy(cfg)
    model_type = kwargs.pop("model_type")
    return CONFIG_MAPPING[model_type](**kwargs)


def _randomize_constants(model: torch.nn.Module) -> None:
    """HF initialises norms and biases to constants; random values let parity tests catch
    a dropped bias or a wrong norm convention (w vs 1 + w)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() != 1 or param.numel() < 2 or not bool((param == param[0]).all()):
                continue
            if name.endswith("bias"):
                param.normal_(0.0, 0.05)
            elif bool((param == 0).all()):  # zero-centred (1 + w) norms, e.g. Qwen3.5
                param.uniform_(-0.3, 0.3)
            else:
                param.uniform_(0.7, 1.3)


def _randomize_mtp_constants(mtp: dict[str, torch.Tensor]) -> None:
    """`_randomize_constants` for the MTP tensors (zero-centred norms start at zero)."""
    with torch.no_grad():
        for t in mtp.values():
            if t.dim() == 1 and bool((t == 0).all()):
                t.uniform_(-0.3, 0.3)


def _to_hub_layout(family: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename/reshape a transformers-5 state dict into the layout published on the hub."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if family in ("qwen2_vl", "qwen2_5_vl"):
            # Qwen2/2.5-VL hub checkpoints keep the LLM at `model.*` and the tower at `visual.*`.
            name = name.replace("model.language_model.", "model.", 1)
            name = name.replace("model.visual.", "visual.", 1)
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            if family == "qwen3_vl_moe":
                # Hub Qwen3-VL-MoE stores fused experts as [E, in, out].
                out[name] = t.transpose(1, 2)
                continue
            prefix, proj = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                if proj == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}.{e}.up_proj.weight"] = up
            continue
        out[name] = t
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sorted(out.items())}


def build_state_dict(family: str, cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights in hub layout; tied lm_head is left out like HF does."""
    hf_cfg = _hf_config(cfg)
    cls = _hf_model_class(cfg["architectures"][0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(hf_cfg)
        _randomize_constants(model)
        # Drawn after the model's weights, so those stay the same with or without MTP.
        mtp = mtp_state_dict(family, hf_cfg)
        _randomize_mtp_constants(mtp)
    sd = {**model.state_dict(), **mtp}
    if cfg.get("tie_word_embeddings") or cfg.get("text_config", {}).get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    return _to_hub_layout(family, sd)


def _dump_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tiny_checkpoint(
    family: str,
    out_dir: str | Path,
    seed: int = 0,
    quantization: str | None = None,
    reference_dir: str | Path | None = None,
    generation_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write a complete tiny HF checkpoint folder for `family` into `out_dir` and return it.

    overrides: `text_config={...}` / `vision_config={...}` merge into those sub-configs; any
    other key is set at the top level of config.json (e.g. `tie_word_embeddings=True`), except:
    `rope_scaling={...}` merges into the text rope parameters (e.g. YaRN, any family), and
    `mtp_num_hidden_layers=N` adds N MTP layers' `mtp.*` weights (Qwen3.5 families).
    `quantization="fp8_block"`: the weights as the -FP8 releases store them
    (tiny_checkpoint_fp8.py); `reference_dir` then also gets their dequantized 16-bit copy.
    generation_config: keys merged over the default generation_config.json (eos ids,
    do_sample=false); a key given as None is removed.
    """
    if quantization not in (None, "fp8_block"):
        raise ValueError(f"quantization must be None or 'fp8_block', got {quantization!r}")
    if reference_dir is not None and quantization is None:
        raise ValueError("reference_dir is the dequantized copy of a quantized checkpoint")
    cfg = build_config_dict(family, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = build_state_dict(family, cfg, seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _dump_json(out / "config.json", cfg)
    write_processing_files(out, cfg)
    if generation_config is not None:
        _write_generation_config(out, generation_config)
    if quantization is not None:
        from .tiny_checkpoint_fp8 import convert_checkpoint_fp8_block

        convert_checkpoint_fp8_block(out, out, reference_dir)
    return out


def _write_generation_config(out: Path, changes: dict[str, Any]) -> None:
    path = out / "generation_config.json"
    merged = {**json.loads(path.read_text(encoding="utf-8")), **changes}
    _dump_json(path, {k: v for k, v in merged.items() if v is not None})


def _is_complete(folder: Path) -> bool:
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    needed = REQUIRED_FILES + (_VL_FILES if "vision_config" in cfg else ())
    return all((folder / name).is_file() and (folder / name).stat().st_size > 0 for name in needed)


def get_or_build_demo_checkpoint(
    family: str = "qwen2_vl", cache_dir: str | Path | None = None
) -> Path:
    """Build the demo checkpoint once into a cache folder and reuse it afterwards.

    The cache root is `cache_dir`, else $TLLM_QWENVL_CACHE, else ~/.cache/tensorrt_llm_qwenvl.
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; expected one of {TINY_FAMILIES}")
    root = Path(
        cache_dir
        or os.environ.get("TLLM_QWENVL_CACHE")
        or Path.home() / ".cache" / "tensorrt_llm_qwenvl"
    ).expanduser()
    target = root / f"demo-{family}-{_DEMO_VERSION}"
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: a crashed or concurrent build never leaves a
    # half-written folder at the final path.
    tmp = Path(tempfile.mkdtemp(prefix=f".demo-{family}-", dir=root))
    try:
        write_tiny_checkpoint(family, tmp, seed=0)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # a concurrent builder did not win either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
