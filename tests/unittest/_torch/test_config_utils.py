"""Config loading and routing: every layout reaches the right model class."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm._torch import config_utils as cu
from tensorrt_llm._torch.model_registry import get_registration
from tensorrt_llm.tools.tiny_checkpoint import TINY_FAMILIES, build_config_dict

EXPECTED_ROUTE = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen_image_bench": "QwenImageBenchForConditionalGeneration",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
HYBRID = {"qwen3_5", "qwen3_5_moe", "qwen_image_bench", "qwen3_next"}


def _write_config(folder: Path, cfg: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_routes_and_loads(tmp_path: Path, family: str) -> None:
    raw = build_config_dict(family)
    assert cu.resolve_architecture(raw) == EXPECTED_ROUTE[family]
    assert cu.is_qwen_image_bench_config(raw) == (family == "qwen_image_bench")
    config = cu.load_pretrained_config(_write_config(tmp_path, raw))
    assert type(config).__name__ == get_registration(EXPECTED_ROUTE[family]).config_class
    # The route survives loading, although transformers renames the legacy vision model_type.
    assert cu.resolve_architecture(config) == EXPECTED_ROUTE[family]
    assert cu.resolve_architecture(config.to_dict()) == EXPECTED_ROUTE[family]
    assert cu.is_hybrid_model(config) == (family in HYBRID)
    assert cu.is_hybrid_model(raw) == (family in HYBRID)
    assert cu.has_vision_tower(config) == ("vision_config" in raw)
    text = getattr(config, "text_config", config)
    assert text.vocab_size == raw.get("text_config", raw)["vocab_size"]


def test_loads_a_written_checkpoint_and_a_bare_json(tmp_path: Path) -> None:
    from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint("qwen3_vl", tmp_path / "ckpt")
    config = cu.load_pretrained_config(path)
    assert config.vision_config.deepstack_visual_indexes == [0]
    assert config.text_config.rope_parameters["mrope_section"] == [3, 3, 2]
    bare = cu.load_pretrained_config(path / "config.json")
    assert bare.to_dict() == config.to_dict()


def test_dense_qwen36_with_language_model_only_false_stays_generic() -> None:
    for family in ("qwen3_5", "qwen3_5_moe"):
        raw = build_config_dict(family)
        assert raw["language_model_only"] is False
        assert not cu.is_qwen_image_bench_config(raw)
        assert cu.resolve_architecture(raw) == EXPECTED_ROUTE[family]
    # Flag present or absent makes no difference to the route.
    raw = build_config_dict("qwen3_5")
    del raw["language_model_only"]
    assert cu.resolve_architecture(raw) == "Qwen3_5ForConditionalGeneration"


def test_image_bench_is_detected_by_vision_model_type() -> None:
    raw = build_config_dict("qwen3_5")
    raw["vision_config"]["model_type"] = "qwen3_5"
    assert cu.is_qwen_image_bench_config(raw)
    assert cu.resolve_architecture(raw) == cu.IMAGE_BENCH_ARCHITECTURE
    assert cu.inner_llm_architecture(cu.resolve_architecture(raw)) == "Qwen3_5ForCausalLM"


def test_language_model_only_checkpoint_is_valid(tmp_path: Path) -> None:
    raw = build_config_dict("qwen3_5", language_model_only=True)
    assert not cu.has_vision_tower(raw)
    config = cu.load_pretrained_config(_write_config(tmp_path, raw))
    assert config.language_model_only is True
    assert not cu.has_vision_tower(config)
    assert cu.resolve_architecture(config) == "Qwen3_5ForConditionalGeneration"
    assert cu.has_vision_tower(build_config_dict("qwen3_5"))
    assert not cu.has_vision_tower(build_config_dict("qwen3"))


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    raw = build_config_dict("qwen2")
    raw["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="LlamaForCausalLM") as err:
        cu.load_pretrained_config(_write_config(tmp_path, raw))
    for arch in cu.SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    no_arch = copy.deepcopy(raw)
    del no_arch["architectures"]
    with pytest.raises(ValueError, match="no `architectures`"):
        cu.resolve_architecture(no_arch)


def test_missing_files_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        cu.load_pretrained_config(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        cu.load_pretrained_config(empty)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        cu.load_pretrained_config(broken)
    (broken / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        cu.load_pretrained_config(broken)


@pytest.mark.parametrize(
    ("arch", "inner"),
    [
        ("Qwen2VLForConditionalGeneration", "Qwen2ForCausalLM"),
        ("Qwen2_5_VLForConditionalGeneration", "Qwen2ForCausalLM"),
        ("Qwen3VLForConditionalGeneration", "Qwen3ForCausalLM"),
        ("Qwen3VLMoeForConditionalGeneration", "Qwen3MoeForCausalLM"),
        ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
        ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
        ("QwenImageBenchForConditionalGeneration", "Qwen3_5ForCausalLM"),
        ("Qwen3VLMoe", "Qwen3MoeForCausalLM"),
        ("Qwen2ForCausalLM", "Qwen2ForCausalLM"),
    ],
)
def test_inner_llm_architecture(arch: str, inner: str) -> None:
    assert cu.inner_llm_architecture(arch) == inner


def test_inner_llm_architecture_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="supported architectures"):
        cu.inner_llm_architecture("LlavaForConditionalGeneration")
