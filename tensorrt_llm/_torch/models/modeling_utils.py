"""`register_auto_model`, the one registration of a model class, and the frozen ModelConfig
every model is built from."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, cast

import torch
from torch import nn

from ...mapping import Mapping as ParallelMapping
from ..model_registry import ModelRegistration, RegistryView, add_registration

# architecture name (HF `architectures[0]`) -> model class: a view of the one registry.
MODEL_CLASS_MAPPING: Mapping[str, type[Any]] = RegistryView(lambda r: r.model_cls)

_M = TypeVar("_M", bound=type[nn.Module])


def register_auto_model(
    name: str,
    *aliases: str,
    input_processor: type[Any],
    config_class: str,
    text_architecture: str | None = None,
    supports_piecewise: bool = False,
) -> Callable[[_M], _M]:
    """Class decorator: register a model class, with everything served along with it.

    `name` (and any `aliases`) are HF architecture names; `input_processor` turns prompts into
    tokens (`TextInputProcessor` for text LLMs); `config_class` is the transformers config class
    that reads config.json; `text_architecture` is the registered causal LM of the text stack
    (default: `name`, a text LLM). `supports_piecewise` becomes the class attribute the
    piecewise prefill graph runner reads: the per-model switch, on where the graphs pay (the
    stack must also split at its mixers, `piecewise_stack.py`)."""

    def wrap(cls: _M) -> _M:
        if "supports_piecewise" in vars(cls):
            raise ValueError(
                f"{cls.__name__} sets supports_piecewise itself; pass it to register_auto_model"
            )
        add_registration(
            *(
                ModelRegistration(
                    architecture=arch,
                    model_cls=cls,
                    input_processor_cls=input_processor,
                    config_class=config_class,
                    text_architecture=text_architecture or name,
                )
                for arch in (name, *aliases)
            )
        )
        # NOTE: set after the registrations so a refused one leaves the class untouched.
        cast(Any, cls).supports_piecewise = supports_piecewise  # RegisteredModel
        return cls

    return wrap


class RegisteredModel(Protocol):
    """What `register_auto_model` adds to a model class."""

    supports_piecewise: ClassVar[bool]


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
    # This rank's place in a tensor-parallel engine (the default: one GPU, no sharding).
    mapping: ParallelMapping = field(default_factory=ParallelMapping)
    # Hybrid models' recurrent (SSM) state element type (float32 unless the user asks).
    ssm_state_dtype: torch.dtype = torch.float32
