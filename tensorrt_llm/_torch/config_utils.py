"""Load a checkpoint's HF config from local files and route it to a model class.

Routing is keyed on the raw config.json: transformers rewrites the legacy image-bench vision
`model_type` ("qwen3_5" -> "qwen3_5_vision") while loading, so the loaded config remembers the
route in `tllm_architecture`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# SUPPORTED_ARCHITECTURES is re-exported: callers import it from here.
from .model_registry import SUPPORTED_ARCHITECTURES, get_registration

IMAGE_BENCH_ARCHITECTURE = "QwenImageBenchForConditionalGeneration"
# NOTE: the attribute a loaded config carries its resolved route in (survives to_dict()).
ROUTE_ATTR = "tllm_architecture"

# NOTE: the config class and inner text LLM of each architecture are registered with its model
# class (`register_auto_model`); this module reads them from the one registry.
_SHORT_SUFFIXES = ("ForConditionalGeneration", "ForCausalLM")

# The dense Qwen3.5/3.6 family publishes vision model_type "qwen3_5_vision"; only image-bench
# checkpoints keep the legacy "qwen3_5". `language_model_only` says nothing about the route.
_IMAGE_BENCH_VISION_MODEL_TYPE = "qwen3_5"


def _as_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise ValueError(f"expected a config dict or PretrainedConfig, got {type(config).__name__}")


def _vision_model_type(config_dict: Mapping[str, Any]) -> str | None:
    vision = config_dict.get("vision_config")
    if isinstance(vision, Mapping):
        return vision.get("model_type")
    return getattr(vision, "model_type", None) if vision is not None else None


def is_qwen_image_bench_config(config_dict: Mapping[str, Any]) -> bool:
    """True only for the legacy image-bench layout (vision sub-config model_type "qwen3_5")."""
    cfg = _as_dict(config_dict)
    if cfg.get(ROUTE_ATTR) is not None:
        return cfg[ROUTE_ATTR] == IMAGE_BENCH_ARCHITECTURE
    if IMAGE_BENCH_ARCHITECTURE in (cfg.get("architectures") or ()):
        return True
    return _vision_model_type(cfg) == _IMAGE_BENCH_VISION_MODEL_TYPE


def resolve_architecture(config_dict: Mapping[str, Any] | Any) -> str:
    """The model-registry key for a config: its HF architecture, or the image-bench route."""
    cfg = _as_dict(config_dict)
    routed = cfg.get(ROUTE_ATTR)
    if routed is not None:
        return routed
    architectures = cfg.get("architectures") or []
    if not isinstance(architectures, (list, tuple)) or not architectures:
        raise ValueError(
            "config has no `architectures` entry; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    arch = architectures[0]
    if is_qwen_image_bench_config(cfg):
        return IMAGE_BENCH_ARCHITECTURE
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported architectures: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return arch


def inner_llm_architecture(arch: str) -> str:
    """The text LLM inside a VL architecture, as a causal-LM registry key.

    Accepts the full name ("Qwen3VLForConditionalGeneration") or its stem ("Qwen3VL").
    """
    for name in SUPPORTED_ARCHITECTURES:
        stem = name
        for suffix in _SHORT_SUFFIXES:
            stem = stem.removesuffix(suffix)
        if arch in (name, stem):
            return get_registration(name).text_architecture
    raise ValueError(
        f"unsupported architecture {arch!r}; supported architectures: "
        + ", ".join(SUPPORTED_ARCHITECTURES)
    )


def _text_config_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    cfg = _as_dict(config)
    text = cfg.get("text_config")
    if isinstance(text, Mapping):
        return dict(text)
    return cfg


def is_hybrid_model(config: Mapping[str, Any] | Any) -> bool:
    """True when the text model mixes linear-attention (Gated DeltaNet) layers in.

    Their recurrent state cannot be rebuilt from cached KV blocks, so KV block reuse is off.
    """
    layer_types = _text_config_dict(config).get("layer_types") or ()
    return "linear_attention" in layer_types


def checkpoint_ssm_state_dtype(config: Mapping[str, Any] | Any) -> str | None:
    """The recurrent state dtype the checkpoint asks for (`mamba_ssm_dtype`, which Qwen3.5 /
    3.6 releases set to "float32"), or None when it names none. The text config's value wins
    over a top-level one, as vLLM reads it."""
    for cfg in (_text_config_dict(config), _as_dict(config)):
        value = cfg.get("mamba_ssm_dtype")
        if value is not None:
            return str(value).removeprefix("torch.")
    return None


def has_vision_tower(config_dict: Mapping[str, Any] | Any) -> bool:
    """False for text LLMs and for `language_model_only: true` VL checkpoints."""
    cfg = _as_dict(config_dict)
    return cfg.get("vision_config") is not None and not cfg.get("language_model_only", False)


def read_config_dict(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The raw config.json of a checkpoint folder (or a path straight to a .json file)."""
    path = Path(checkpoint_dir)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    config_file = path if path.is_file() else path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint folder: {path}")
    try:
        cfg = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from err
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def load_pretrained_config(checkpoint_dir: str | Path) -> Any:
    """Read config.json with the transformers config class of its architecture (no hub access).

    The result carries `tllm_architecture`, the resolved registry key (see resolve_architecture).
    """
    import transformers

    raw = read_config_dict(checkpoint_dir)
    arch = resolve_architecture(raw)
    class_name = get_registration(arch).config_class
    config_cls = getattr(transformers, class_name, None)
    if config_cls is None:
        raise ValueError(
            f"architecture {arch!r} needs transformers.{class_name}, which transformers "
            f"{transformers.__version__} does not have"
        )
    kwargs = dict(raw)
    kwargs.pop(ROUTE_ATTR, None)
    config = config_cls.from_dict(kwargs)
    setattr(config, ROUTE_ATTR, arch)
    return config
