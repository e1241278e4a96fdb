"""AutoModelForCausalLM: pick the registered class for a checkpoint's architecture."""

from __future__ import annotations

from torch import nn

from ..model_registry import get_registration, import_all_registrations


def import_all_models() -> dict[str, type[nn.Module]]:
    """Every supported architecture's model class (importing the modules that register them)."""
    return {arch: reg.model_cls for arch, reg in import_all_registrations().items()}


def get_model_class(architecture: str) -> type[nn.Module]:
    cls: type[nn.Module] = get_registration(architecture).model_cls
    return cls
