"""Every architecture is registered once, with all its parts, by its model class
(`register_auto_model`), and every consumer reads that one registration: config routing,
input processors, the model factory. A registration missing a part (a processor, a config
route, a model) or a name the lazy module table does not list is a dead entry or a startup
crash."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest
import transformers
from torch import nn

import tensorrt_llm._torch.models as models_pkg
from tensorrt_llm._torch import config_utils, model_registry
from tensorrt_llm._torch.model_registry import (
    MODEL_REGISTRY,
    SUPPORTED_ARCHITECTURES,
    ModelRegistration,
    get_registration,
)
from tensorrt_llm._torch.models.modeling_auto import get_model_class, import_all_models
from tensorrt_llm._torch.models.modeling_utils import MODEL_CLASS_MAPPING, register_auto_model
from tensorrt_llm.inputs.registry import (
    INPUT_PROCESSOR_REGISTRY,
    TextInputProcessor,
    get_input_processor_class,
)

# The per-model switch of piecewise prefill graphs: dense and MoE Qwen-VL, the hybrid Qwen3.5 /
# 3.6 stacks and the MoE / hybrid text LLMs (the dense text LLMs were never measured).
PIECEWISE = {
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "QwenImageBenchForConditionalGeneration",
    "Qwen3MoeForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
}


def _problems(reg: ModelRegistration) -> list[str]:
    """What is wrong with one registration (empty when it is complete and consistent)."""
    problems = [f"no {part}" for part in model_registry.missing_parts(reg)]
    if problems:
        return problems
    cls = reg.model_cls
    if not issubclass(cls, nn.Module):
        problems.append(f"model {cls.__name__} is not an nn.Module")
    if cls.__module__ != model_registry._REGISTERING_MODULES.get(reg.architecture):
        problems.append(f"registered in {cls.__module__}, not in the module the lazy table names")
    if not isinstance(vars(cls).get("supports_piecewise"), bool):
        problems.append("no supports_piecewise class attribute of its own")
    proc = reg.input_processor_cls
    defined = {name for klass in proc.__mro__ for name in vars(klass)}
    if not {"__call__", "get_dummy_prompt"} <= defined:
        problems.append(f"processor {proc.__name__} lacks __call__ / get_dummy_prompt")
    is_vl = hasattr(cls, "vision_model_cls")
    if is_vl == (proc is TextInputProcessor):
        problems.append(f"{'vision' if is_vl else 'text'} model with processor {proc.__name__}")
    if getattr(transformers, reg.config_class, None) is None:
        problems.append(f"transformers has no {reg.config_class}")
    text = reg.text_architecture
    if text not in SUPPORTED_ARCHITECTURES:
        problems.append(f"text architecture {text!r} is not registered")
    elif get_registration(text).text_architecture != text:
        problems.append(f"text architecture {text!r} is not a text LLM")
    if not is_vl and text != reg.architecture:
        problems.append("a text LLM must name itself as its text architecture")
    return problems


def test_every_registered_class_has_all_its_parts() -> None:
    registrations = model_registry.import_all_registrations()
    assert list(registrations) == list(SUPPORTED_ARCHITECTURES)
    problems = {arch: _problems(reg) for arch, reg in registrations.items()}
    assert {arch: p for arch, p in problems.items() if p} == {}


def test_the_completeness_check_finds_a_missing_part() -> None:
    reg = get_registration("Qwen2VLForConditionalGeneration")
    assert _problems(dataclasses.replace(reg, input_processor_cls=None)) == ["no input processor"]
    assert _problems(dataclasses.replace(reg, config_class="")) == ["no config class"]
    assert _problems(dataclasses.replace(reg, input_processor_cls=TextInputProcessor)) == [
        "vision model with processor TextInputProcessor"
    ]
    assert _problems(dataclasses.replace(reg, text_architecture="Qwen9ForCausalLM")) == [
        "text architecture 'Qwen9ForCausalLM' is not registered"
    ]
    assert _problems(dataclasses.replace(reg, architecture="Qwen9VL")) == [
        "registered in tensorrt_llm._torch.models.modeling_qwen2vl, not in the module the "
        "lazy table names"
    ]


def test_no_module_registers_a_name_the_lazy_table_does_not_list() -> None:
    for info in pkgutil.iter_modules(models_pkg.__path__):
        importlib.import_module(f"{models_pkg.__name__}.{info.name}")
    assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def test_consumers_read_the_one_registration() -> None:
    classes = import_all_models()
    for arch in SUPPORTED_ARCHITECTURES:
        reg = get_registration(arch)
        assert classes[arch] is get_model_class(arch) is MODEL_CLASS_MAPPING[arch] is reg.model_cls
        assert get_input_processor_class(arch) is INPUT_PROCESSOR_REGISTRY[arch]
        assert INPUT_PROCESSOR_REGISTRY[arch] is reg.input_processor_cls
        assert config_utils.inner_llm_architecture(arch) == reg.text_architecture
    assert config_utils.SUPPORTED_ARCHITECTURES is SUPPORTED_ARCHITECTURES
    assert config_utils.IMAGE_BENCH_ARCHITECTURE in SUPPORTED_ARCHITECTURES
    assert "LlamaForCausalLM" not in INPUT_PROCESSOR_REGISTRY
    with pytest.raises(KeyError):
        MODEL_CLASS_MAPPING["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="unsupported architecture 'LlamaForCausalLM'"):
        get_model_class("LlamaForCausalLM")


def test_piecewise_switch_per_model() -> None:
    for arch, cls in import_all_models().items():
        assert cls.supports_piecewise is (arch in PIECEWISE), arch
        assert get_registration(arch).supports_piecewise is (arch in PIECEWISE)


class _Other(nn.Module):
    pass


def test_a_second_class_under_a_registered_name_raises() -> None:
    before = dict(MODEL_REGISTRY)
    qwen2 = get_registration("Qwen2ForCausalLM")
    with pytest.raises(ValueError, match="'Qwen2ForCausalLM' is already registered to Qwen2For"):
        register_auto_model(
            "Qwen2ForCausalLM", input_processor=TextInputProcessor, config_class="Qwen2Config"
        )(_Other)
    # All or nothing: a refused alias leaves the first name unregistered too.
    with pytest.raises(ValueError, match="already registered"):
        register_auto_model(
            "Qwen9ForCausalLM",
            "Qwen2ForCausalLM",
            input_processor=TextInputProcessor,
            config_class="Qwen2Config",
        )(_Other)
    # The same class with other parts is a second registration too.
    with pytest.raises(ValueError, match="Qwen2ForCausalLM with other parts"):
        model_registry.add_registration(dataclasses.replace(qwen2, config_class="Qwen3Config"))
    model_registry.add_registration(qwen2)  # the same registration again is a no-op
    assert MODEL_REGISTRY == before
    assert "supports_piecewise" not in vars(_Other)


def test_a_registration_without_a_part_raises() -> None:
    before = dict(MODEL_REGISTRY)
    with pytest.raises(ValueError, match="'Qwen9VL' is registered without: input processor"):
        register_auto_model("Qwen9VL", input_processor=None, config_class="Qwen2VLConfig")(_Other)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="without: config class"):
        register_auto_model("Qwen9VL", input_processor=TextInputProcessor, config_class="")(_Other)

    class SetsItsOwn(nn.Module):
        supports_piecewise = True

    with pytest.raises(ValueError, match="sets supports_piecewise itself"):
        register_auto_model(
            "Qwen9VL", input_processor=TextInputProcessor, config_class="Qwen2VLConfig"
        )(SetsItsOwn)
    assert MODEL_REGISTRY == before
