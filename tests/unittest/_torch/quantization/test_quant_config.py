"""QuantConfig from config.json, modules_to_not_convert matching, and the load-time errors:
unsupported methods, e4m3 tensors for 16-bit parameters, missing or extra scales, 16-bit
tensors for block-FP8 layers, fused shards with partial blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fp8_block_helpers import load_engine, prefill_and_greedy, write_pair
from safetensors.torch import load_file, save_file

import tensorrt_llm._torch.modules.linear as linear_mod
from tensorrt_llm._torch.modules.fp8_block_linear import merge_shard_scales, scale_rows
from tensorrt_llm._torch.modules.triton_kernels.fp8_block import (
    dequantize_weight_fp8_block,
    quantize_weight_fp8_block,
)
from tensorrt_llm._torch.quantization import (
    QuantConfig,
    checkpoint_module_names,
    matches,
    resolve_quant_config,
)
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

RELEASE = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.visual"],
}


class _Cfg:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def test_release_config_parses_from_top_level_or_text_config() -> None:
    want = QuantConfig(modules_to_not_convert=("lm_head", "model.visual"))
    assert QuantConfig.from_pretrained_config(_Cfg(quantization_config=RELEASE)) == want
    nested = _Cfg(text_config=_Cfg(quantization_config=RELEASE))
    assert QuantConfig.from_pretrained_config(nested) == want
    assert QuantConfig.from_pretrained_config(_Cfg()) is None
    other = {**RELEASE, "modules_to_not_convert": []}
    both = _Cfg(quantization_config=RELEASE, text_config=_Cfg(quantization_config=other))
    with pytest.raises(ValueError, match="two different quantization_config"):
        QuantConfig.from_pretrained_config(both)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method='awq'.*supported: 'fp8'"),
        ({"quant_method": "gptq"}, "quant_method='gptq'"),
        ({"quant_method": "compressed-tensors"}, "quant_method='compressed-tensors'"),
        ({"quant_method": "modelopt"}, "quant_method='modelopt'"),
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
        ({**RELEASE, "activation_scheme": "static"}, "activation_scheme='static'"),
        ({**RELEASE, "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({**RELEASE, "weight_block_size": [128]}, "two positive ints"),
        ({**RELEASE, "kv_cache_scheme": "fp8"}, "not supported: \\['kv_cache_scheme'\\]"),
        ({**RELEASE, "dequantize": True}, "not supported: \\['dequantize'\\]"),
    ],
)
def test_unsupported_quantization_is_a_clear_error(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantConfig.from_dict(raw)


def test_unknown_method_fails_at_load(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3", tmp_path, quantization_config={"quant_method": "awq"})
    with pytest.raises(ValueError, match="quant_method='awq'"):
        LlmArgs(model=str(ckpt), device="cpu").to_engine_config()


@pytest.mark.parametrize(
    ("pattern", "name", "hit"),
    [
        ("lm_head", "lm_head", True),
        ("model.visual", "model.visual.blocks.0.attn.qkv", True),  # prefix
        ("visual", "model.visual.blocks.0.attn.qkv", True),  # whole components inside
        ("mlp.gate", "model.layers.3.mlp.gate", True),  # suffix
        ("mlp.gate", "model.layers.3.mlp.gate_proj", False),  # never a partial component
        ("mlp.shared_expert_gate", "model.layers.0.mlp.shared_expert_gate", True),
        ("model.layers.1", "model.layers.11.mlp.up_proj", False),
        ("model.layers.1", "model.layers.1.mlp.up_proj", True),
        ("linear_attn.in_proj_a", "model.layers.0.linear_attn.in_proj_a", True),
        ("self_attn", "model.layers.0.self_attn.q_proj", True),
    ],
)
def test_modules_to_not_convert_matching(pattern: str, name: str, hit: bool) -> None:
    assert matches(pattern, name) is hit


def test_our_names_map_to_every_checkpoint_layout() -> None:
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    names = checkpoint_module_names("llm.model.layers.0.self_attn.qkv_proj", fused)
    assert "model.layers.0.self_attn.k_proj" in names
    assert "model.language_model.layers.0.self_attn.v_proj" in names
    assert checkpoint_module_names("visual.blocks.0.attn.qkv") == [
        "visual.blocks.0.attn.qkv",
        "model.visual.blocks.0.attn.qkv",
    ]
    assert checkpoint_module_names("model.layers.0.mlp.down_proj") == [
        "model.layers.0.mlp.down_proj"
    ]


def test_fp8_on_a_block_checkpoint_is_an_error(tmp_path: Path) -> None:
    fp8, ref = write_pair("qwen3", tmp_path)
    with pytest.raises(ValueError, match="already block-FP8"):
        LlmArgs(model=str(fp8), device="cpu", quantization="fp8").to_engine_config()
    assert LlmArgs(model=str(ref), device="cpu", quantization="fp8").to_engine_config()
    config = resolve_quant_config("fp8_block", _Cfg())
    assert config is not None and not config.from_checkpoint


def _edit(fp8: Path, out: Path, *, drop_config: bool = False, weights: Any = None) -> Path:
    out.mkdir()
    for f in fp8.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    if drop_config:
        cfg = json.loads((out / "config.json").read_text())
        cfg.pop("quantization_config")
        (out / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        tensors = weights(load_file(str(fp8 / "model.safetensors")))
        save_file(tensors, str(out / "model.safetensors"))
    return out


def test_e4m3_tensors_never_load_into_16bit_parameters(tmp_path: Path) -> None:
    fp8, _ = write_pair("qwen3", tmp_path)
    plain = _edit(fp8, tmp_path / "no_config", drop_config=True)
    with pytest.raises(ValueError, match="weight_scale_inv tensors for layers"):
        load_engine(plain)
    no_scales = _edit(
        fp8,
        tmp_path / "no_scales",
        drop_config=True,
        weights=lambda w: {k: v for k, v in w.items() if not k.endswith("weight_scale_inv")},
    )
    with pytest.raises(ValueError, match="FP8 tensors are never loaded as 16-bit"):
        load_engine(no_scales)


def test_missing_scale_and_16bit_layer_are_errors(tmp_path: Path) -> None:
    fp8, ref = write_pair("qwen3", tmp_path)
    name = "model.layers.1.self_attn.k_proj"
    missing = _edit(
        fp8,
        tmp_path / "missing",
        weights=lambda w: {k: v for k, v in w.items() if k != f"{name}.weight_scale_inv"},
    )
    with pytest.raises(ValueError, match=f"missing 1 weights: {name}.weight_scale_inv"):
        load_engine(missing)
    ref_w = load_file(str(ref / "model.safetensors"))

    def one_16bit(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        w = {k: v for k, v in w.items() if k != f"{name}.weight_scale_inv"}
        return {**w, f"{name}.weight": ref_w[f"{name}.weight"]}

    sixteen = _edit(fp8, tmp_path / "sixteen", weights=one_16bit)
    with pytest.raises(ValueError, match="missing 1 weights"):
        load_engine(sixteen)
    # Listed in modules_to_not_convert, the fused qkv mixes 16-bit and FP8 parts.
    cfg = json.loads((sixteen / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].append(name)
    (sixteen / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="either all block-FP8 or all 16-bit"):
        load_engine(sixteen)


@pytest.mark.parametrize(
    ("splits", "bn"), [((256, 128, 128), 128), ((192, 96, 96), 1), ((200, 200), 1), ((300,), 128)]
)
def test_fused_shard_scales_stay_exact(splits: tuple[int, ...], bn: int) -> None:
    torch.manual_seed(0)
    shards = [torch.randn(n, 200) for n in splits]
    pairs = [quantize_weight_fp8_block(w) for w in shards]
    assert scale_rows(splits, (128, 128)) == bn
    merged = merge_shard_scales([q for q, _ in pairs], [s for _, s in pairs], (128, 128), bn)
    fused = torch.cat([q for q, _ in pairs])
    want = torch.cat([dequantize_weight_fp8_block(q, s) for q, s in pairs])
    assert torch.equal(dequantize_weight_fp8_block(fused, merged, (bn, 128)), want)


def test_tiny_config_with_partial_blocks_loads_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v of 192/96/96 rows and gate/up of 200: row-granular scales, still exact."""
    src = write_tiny_checkpoint(
        "qwen3", tmp_path / "src", head_dim=48, intermediate_size=200, num_attention_heads=4
    )
    from tensorrt_llm.tools.tiny_checkpoint_fp8 import convert_checkpoint_fp8_block

    fp8 = convert_checkpoint_fp8_block(src, tmp_path / "fp8", tmp_path / "ref")
    engine = load_engine(fp8)
    layer = engine.model.model.layers[0]
    assert layer.self_attn.qkv_proj.fp8_block == (1, 128)
    assert layer.mlp.gate_up_proj.fp8_block == (1, 128)
    assert layer.self_attn.o_proj.fp8_block == (128, 128)

    def dequantized(x, weight, scale_inv, bias, block):  # type: ignore[no-untyped-def]
        return torch.nn.functional.linear(
            x, dequantize_weight_fp8_block(weight, scale_inv, block), bias
        )

    monkeypatch.setattr(linear_mod, "fp8_block_forward", dequantized)
    ids = list(range(30, 50))
    got, _ = prefill_and_greedy(engine, fp8, ids, 1)
    want, _ = prefill_and_greedy(load_engine(tmp_path / "ref"), tmp_path / "ref", ids, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_bench_takes_fp8_block(tmp_path: Path) -> None:
    from tensorrt_llm.commands.bench import parse_args, serve_flags

    args = parse_args(["--config", "c.json", "--quantization", "fp8_block", "--device", "cpu"])
    assert args.quantization == "fp8_block"
    flags = serve_flags(args, tmp_path)
    assert flags[flags.index("--quantization") + 1] == "fp8_block"
    with pytest.raises(SystemExit):
        parse_args(["--config", "c.json", "--quantization", "awq"])
