"""The one registry of model architectures.

Each model class registers itself with one class decorator,
`models.modeling_utils.register_auto_model(name, input_processor=, config_class=,
text_architecture=, supports_piecewise=)`, which records everything the rest of the package
needs to know about an HF architecture name: the model class, its input processor, the
transformers config class that loads its config.json, the text LLM inside it, and (on the
class, `supports_piecewise`) whether piecewise prefill graphs may run it. Config routing
(`config_utils`), the input-processor registry (`inputs/registry.py`) and `modeling_auto`
all read `get_registration` here.

This module imports nothing of the package: it sits below both `inputs` and `_torch/models`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

_V = TypeVar("_V")


@dataclass(frozen=True)
class ModelRegistration:
    """What one HF architecture name is served with."""

    architecture: str
    model_cls: type[Any]
    input_processor_cls: type[Any]
    # transformers config class that reads the checkpoint's config.json (looked up by name, so
    # registering a model needs no transformers import).
    config_class: str
    # The causal-LM architecture of the text stack; a text LLM names itself.
    text_architecture: str

    @property
    def supports_piecewise(self) -> bool:
        return bool(getattr(self.model_cls, "supports_piecewise", False))


MODEL_REGISTRY: dict[str, ModelRegistration] = {}

_MODELS = "tensorrt_llm._torch.models."
# NOTE: the one table besides the decorators, kept because of the import layering: the model
# modules import `inputs` (the text processor, prompt types), so neither `inputs/registry.py`
# nor `config_utils` may import `_torch/models`. They name an architecture, and the module
# that registers it is imported by name here on first use (which also keeps the text-only
# front end from importing the vision models). `SUPPORTED_ARCHITECTURES` is its key list;
# tests/unittest/test_architecture_tables.py checks it against the decorators.
_REGISTERING_MODULES: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": _MODELS + "modeling_qwen2vl",
    "Qwen2_5_VLForConditionalGeneration": _MODELS + "modeling_qwen2vl",
    "Qwen3VLForConditionalGeneration": _MODELS + "modeling_qwen3vl",
    "Qwen3VLMoeForConditionalGeneration": _MODELS + "modeling_qwen3vl_moe",
    "Qwen3_5ForConditionalGeneration": _MODELS + "modeling_qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": _MODELS + "modeling_qwen3_5",
    "QwenImageBenchForConditionalGeneration": _MODELS + "modeling_qwen3_5",
    "Qwen2ForCausalLM": _MODELS + "modeling_qwen2",
    "Qwen3ForCausalLM": _MODELS + "modeling_qwen3",
    "Qwen3MoeForCausalLM": _MODELS + "modeling_qwen3_moe",
    "Qwen3_5ForCausalLM": _MODELS + "modeling_qwen3_5",
    "Qwen3_5MoeForCausalLM": _MODELS + "modeling_qwen3_5",
    "Qwen3NextForCausalLM": _MODELS + "modeling_qwen3_5",
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_REGISTERING_MODULES)


def missing_parts(registration: ModelRegistration) -> list[str]:
    """The parts a registration lacks (empty when it is complete)."""
    missing = []
    if not isinstance(registration.model_cls, type):
        missing.append("model class")
    if not isinstance(registration.input_processor_cls, type):
        missing.append("input processor")
    if not registration.config_class:
        missing.append("config class")
    if not registration.text_architecture:
        missing.append("text architecture")
    return missing


def add_registration(*registrations: ModelRegistration) -> None:
    """Record architectures, all or none; a second class under a registered name raises."""
    for registration in registrations:
        name = registration.architecture
        missing = missing_parts(registration)
        if missing:
            raise ValueError(f"architecture {name!r} is registered without: {', '.join(missing)}")
        current = MODEL_REGISTRY.get(name)
        if current is not None and current != registration:
            what = current.model_cls.__name__
            if current.model_cls is registration.model_cls:
                what += " with other parts"
            raise ValueError(f"architecture {name!r} is already registered to {what}")
    for registration in registrations:
        MODEL_REGISTRY[registration.architecture] = registration


def _unsupported(arch: object) -> ValueError:
    return ValueError(
        f"unsupported architecture {arch!r}; supported architectures: "
        + ", ".join(SUPPORTED_ARCHITECTURES)
    )


def get_registration(arch: str) -> ModelRegistration:
    """The registration of an architecture, importing the module that registers it."""
    if arch not in MODEL_REGISTRY and arch in _REGISTERING_MODULES:
        importlib.import_module(_REGISTERING_MODULES[arch])
    registration = MODEL_REGISTRY.get(arch)
    if registration is None:
        raise _unsupported(arch)
    return registration


def import_all_registrations() -> dict[str, ModelRegistration]:
    """Every supported architecture's registration, in `SUPPORTED_ARCHITECTURES` order."""
    return {arch: get_registration(arch) for arch in SUPPORTED_ARCHITECTURES}


class RegistryView(Mapping[str, _V]):
    """A read-only architecture -> part view of the registry (`MODEL_CLASS_MAPPING`,
    `INPUT_PROCESSOR_REGISTRY`); looking a name up imports the module that registers it."""

    def __init__(self, part: Callable[[ModelRegistration], _V]) -> None:
        self._part = part

    def __getitem__(self, arch: str) -> _V:
        if arch not in _REGISTERING_MODULES and arch not in MODEL_REGISTRY:
            raise KeyError(arch)
        return self._part(get_registration(arch))

    def __contains__(self, arch: object) -> bool:
        return arch in _REGISTERING_MODULES or arch in MODEL_REGISTRY

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys((*SUPPORTED_ARCHITECTURES, *MODEL_REGISTRY)))

    def __len__(self) -> int:
        return len(set(SUPPORTED_ARCHITECTURES) | set(MODEL_REGISTRY))
