"""The tiny checkpoint writer: HF loads every family completely, tokenizer ids match the config."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from safetensors import safe_open

from tensorrt_llm.tools import tiny_checkpoint as tc

DEMO_PNG = Path(tc.__file__).resolve().parent.parent / "assets" / "demo.png"
VL_FAMILIES = tuple(f for f in tc.TINY_FAMILIES if f not in ("qwen2", "qwen3", "qwen3_next"))


def _keys_and_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _reference_model(cfg: dict, seed: int) -> torch.nn.Module:
    """The HF model the writer should have saved, rebuilt independently from the same seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tc._hf_model_class(cfg["architectures"][0])(tc._hf_config(cfg))
        tc._randomize_constants(model)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, float]]:
    out: dict[str, tuple[Path, float]] = {}
    for family in tc.TINY_FAMILIES:
        start = time.perf_counter()
        path = tc.write_tiny_checkpoint(family, tmp_path_factory.mktemp(family))
        out[family] = (path, time.perf_counter() - start)
    return out


@pytest.mark.parametrize("family", tc.TINY_FAMILIES)
def test_hf_loads_every_weight(built: dict[str, tuple[Path, float]], family: str) -> None:
    path, seconds = built[family]
    assert seconds < 10.0, f"{family} took {seconds:.1f} s to build"
    cfg = json.loads((path / "config.json").read_text())
    model, info = tc._hf_model_class(cfg["architectures"][0]).from_pretrained(
        str(path), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    expected = _reference_model(cfg, seed=0).state_dict()
    loaded = model.state_dict()
    assert expected.keys() == loaded.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", tc.TINY_FAMILIES)
def test_tokenizer_ids_match_config(built: dict[str, tuple[Path, float]], family: str) -> None:
    path, _ = built[family]
    cfg = json.loads((path / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert len(tok) <= tc.VOCAB_SIZE
    for text, tid in tc.SPECIAL_IDS.items():
        assert tok.convert_tokens_to_ids(text) == tid
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What is it?"}]
    messages = [{"role": "user", "content": content}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>")
    assert text.endswith("What is it?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids[0] == tc.SPECIAL_IDS["<|im_start|>"]
    if "vision_config" in cfg:
        assert ids.count(cfg["image_token_id"]) == 1
        assert ids.count(cfg["video_token_id"]) == 1
        assert ids.count(cfg["vision_start_token_id"]) == 2
        assert ids.count(cfg["vision_end_token_id"]) == 2
    eos = cfg.get("text_config", cfg)["eos_token_id"]
    assert eos == tc.SPECIAL_IDS["<|im_end|>"] == tok.eos_token_id
    assert tok.decode(tok("a red square")["input_ids"]) == "a red square"


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_image_processor_matches_vision_config(
    built: dict[str, tuple[Path, float]], family: str
) -> None:
    path, _ = built[family]
    vision = json.loads((path / "config.json").read_text())["vision_config"]
    proc = transformers.AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
    out = proc(images=[Image.open(DEMO_PNG)], return_tensors="pt")
    t, h, w = (int(x) for x in out["image_grid_thw"][0])
    patch, temporal = vision["patch_size"], vision["temporal_patch_size"]
    assert t == 1 and h % 2 == 0 and w % 2 == 0
    assert out["pixel_values"].shape == (t * h * w, 3 * temporal * patch * patch)
    assert 4 <= h * w // 4 <= 64  # a small image gives a handful of merged tokens
    video = json.loads((path / "video_preprocessor_config.json").read_text())
    assert (video["patch_size"], video["merge_size"]) == (patch, vision["spatial_merge_size"])


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = tc.write_tiny_checkpoint("qwen3_vl", tmp_path / "a", seed=3)
    b = tc.write_tiny_checkpoint("qwen3_vl", tmp_path / "b", seed=3)
    c = tc.write_tiny_checkpoint("qwen3_vl", tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_building_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    tc.write_tiny_checkpoint("qwen2", tmp_path)
    torch.testing.assert_close(torch.rand(4), expected)


def test_hub_layouts(built: dict[str, tuple[Path, float]]) -> None:
    qwen2_vl = _keys_and_shapes(built["qwen2_vl"][0])
    assert "model.layers.0.self_attn.q_proj.weight" in qwen2_vl
    assert "visual.blocks.0.attn.qkv.weight" in qwen2_vl
    moe = _keys_and_shapes(built["qwen3_vl_moe"][0])
    # [experts, hidden, 2 * moe_intermediate] / [experts, moe_intermediate, hidden]
    assert moe["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 96)
    assert moe["model.language_model.layers.0.mlp.experts.down_proj"] == (4, 48, 64)
    moe35 = _keys_and_shapes(built["qwen3_5_moe"][0])
    assert moe35["model.language_model.layers.0.mlp.experts.3.gate_proj.weight"] == (48, 64)
    assert "model.language_model.layers.0.mlp.shared_expert.up_proj.weight" in moe35
    qwen35 = json.loads((built["qwen3_5"][0] / "config.json").read_text())
    assert qwen35["text_config"]["layer_types"].count("linear_attention") == 3
    assert qwen35["vision_config"]["model_type"] == "qwen3_5_vision"
    bench = json.loads((built["qwen_image_bench"][0] / "config.json").read_text())
    assert bench["vision_config"]["model_type"] == "qwen3_5"
    assert bench["language_model_only"] is False


def test_overrides_and_tied_embeddings(tmp_path: Path) -> None:
    path = tc.write_tiny_checkpoint(
        "qwen2_vl", tmp_path, tie_word_embeddings=True, text_config={"num_hidden_layers": 1}
    )
    keys = _keys_and_shapes(path)
    assert "lm_head.weight" not in keys
    assert not any(k.startswith("model.layers.1.") for k in keys)
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(str(path))
    torch.testing.assert_close(
        model.lm_head.weight, model.model.language_model.embed_tokens.weight, rtol=0, atol=0
    )


def test_bad_arguments_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny family"):
        tc.write_tiny_checkpoint("llama", tmp_path)
    with pytest.raises(ValueError, match="vision_config"):
        tc.write_tiny_checkpoint("qwen3", tmp_path, vision_config={"depth": 1})
    with pytest.raises(ValueError, match="must be a dict"):
        tc.write_tiny_checkpoint("qwen3_vl", tmp_path, text_config=3)


def test_demo_checkpoint_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLLM_QWENVL_CACHE", str(tmp_path / "env"))
    first = tc.get_or_build_demo_checkpoint("qwen2_vl")
    assert first == tmp_path / "env" / "demo-qwen2_vl-v1"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tc.get_or_build_demo_checkpoint("qwen2_vl") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dirs left
    # An incomplete cached folder is rebuilt rather than trusted.
    os.remove(first / "tokenizer.json")
    assert tc.get_or_build_demo_checkpoint("qwen2_vl") == first
    assert (first / "tokenizer.json").is_file()
    explicit = tc.get_or_build_demo_checkpoint("qwen2", cache_dir=tmp_path / "explicit")
    assert explicit.parent == tmp_path / "explicit" and (explicit / "config.json").is_file()


def test_demo_image() -> None:
    image = Image.open(DEMO_PNG)
    assert image.size == (96, 72) and image.mode == "RGB"
    colours = image.getcolors(maxcolors=96 * 72)
    assert colours is not None and len(colours) > 8  # colourful, not blank
