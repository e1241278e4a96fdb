"""Model registry and the frozen ModelConfig every model is built from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

# architecture name (HF `architectures[0]`) -> model class
MODEL_CLASS_MAPPING: dict[str, type[nn.Module]] = {}

_M = TypeVar("_M", bound=type[nn.Module])


def register_auto_model(name: str) -> Callable[[_M], _M]:
    """Class decorator: register a model class under an HF architecture name."""

    def wrap(cls: _M) -> _M:
        if name in MODEL_CLASS_MAPPING and MODEL_CLASS_MAPPING[name] is not cls:
            raise ValueError(f"architecture {name!r} is already registered")
        MODEL_CLASS_MAPPING[name] = cls
        return cls

    return wrap


@dataclass(frozen=True)
class ModelConfig:
    """Everything a model needs to build itself. Normalised once, never mutated.

    `pretrained_config` is the HF config (the composite one for VL models).
    `max_num_seq_slots` sizes per-slot state such as the mRoPE delta cache (which adds one
    dummy slot on top).
    """

    pretrained_config: Any
    torch_dtype: torch.dtype = torch.float32
    attn_backend: str = "vanilla"
    max_num_seq_slots: int = 8
    max_num_tokens: int = 8192
    checkpoint_dir: str | None = None
