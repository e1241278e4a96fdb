"""AutoModelForCausalLM: pick the registered class for a checkpoint's architecture."""

from __future__ import annotations

import importlib

from torch import nn

from .modeling_utils import MODEL_CLASS_MAPPING

# Importing these modules registers their classes (registries, not if-chains).
_MODEL_MODULES = (
    "modeling_qwen2",
    "modeling_qwen3",
    "modeling_qwen2vl",
    "modeling_qwen3vl",
    "modeling_qwen3vl_moe",
    "modeling_qwen3_moe",
    "modeling_qwen3_next",
    "modeling_qwen3_5",
)


def import_all_models() -> dict[str, type[nn.Module]]:
    for name in _MODEL_MODULES:
        importlib.import_module(f"{__package__}.{name}")
    return MODEL_CLASS_MAPPING


def get_model_class(architecture: str) -> type[nn.Module]:
    mapping = import_all_models()
    cls = mapping.get(architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(mapping)}")
    return cls
