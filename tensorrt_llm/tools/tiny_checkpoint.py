"""Tiny random HF-format checkpoints for every Qwen(-VL) family, built locally in well under 1 s.

Tests, the demo and the benchmarks share this writer, so nobody needs hub access. Each folder holds
config.json, model.safetensors (hub layout), a locally trained byte-level BPE tokenizer with the
Qwen special tokens, a Qwen-style chat template, and the image/video processor configs.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .tiny_configs import (  # noqa: F401  (re-exported: tests and tools import them here)
    HIDDEN,
    TINY_FAMILIES,
    VOCAB_SIZE,
    build_config_dict,
)
from .tiny_mtp import mtp_state_dict
from .tiny_tokenizer import (  # noqa: F401  (re-exported: tests and tools import them here)
    BPE_VOCAB_SIZE,
    CHAT_TEMPLATE,
    SPECIAL_IDS,
    SPECIAL_TOKENS,
    build_tokenizer,
    write_processing_files,
)

_DEMO_VERSION = "v1"
# NOTE: every file get_or_build_demo_checkpoint requires before it trusts a cached folder.
REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
_VL_FILES: tuple[str, ...] = ("preprocessor_config.json", "video_preprocessor_config.json")


def _hf_model_class(architecture: str) -> type:
    import transformers

    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {architecture}")
    return cls


def _hf_config(cfg: dict[str, Any]) -> Any:
    from transformers import CONFIG_MAPPING

    kwargs = copy.deepcopy(cfg)
    model_type = kwargs.pop("model_type")
    return CONFIG_MAPPING[model_type](**kwargs)


def _randomize_constants(model: torch.nn.Module) -> None:
    """HF initialises norms and biases to constants; random values let parity tests catch
    a dropped bias or a wrong norm convention (w vs 1 + w)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() != 1 or param.numel() < 2 or not bool((param == param[0]).all()):
                continue
            if name.endswith("bias"):
                param.normal_(0.0, 0.05)
            elif bool((param == 0).all()):  # zero-centred (1 + w) norms, e.g. Qwen3.5
                param.uniform_(-0.3, 0.3)
            else:
                param.uniform_(0.7, 1.3)


def _randomize_mtp_constants(mtp: dict[str, torch.Tensor]) -> None:
    """`_randomize_constants` for the MTP tensors (zero-centred norms start at zero)."""
    with torch.no_grad():
        for t in mtp.values():
            if t.dim() == 1 and bool((t == 0).all()):
                t.uniform_(-0.3, 0.3)


def _to_hub_layout(family: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename/reshape a transformers-5 state dict into the layout published on the hub."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if family in ("qwen2_vl", "qwen2_5_vl"):
            # Qwen2/2.5-VL hub checkpoints keep the LLM at `model.*` and the tower at `visual.*`.
            name = name.replace("model.language_model.", "model.", 1)
            name = name.replace("model.visual.", "visual.", 1)
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            if family == "qwen3_vl_moe":
                # Hub Qwen3-VL-MoE stores fused experts as [E, in, out].
                out[name] = t.transpose(1, 2)
                continue
            prefix, proj = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                if proj == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}.{e}.up_proj.weight"] = up
            continue
        out[name] = t
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sorted(out.items())}


def build_state_dict(family: str, cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights in hub layout; tied lm_head is left out like HF does."""
    hf_cfg = _hf_config(cfg)
    cls = _hf_model_class(cfg["architectures"][0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(hf_cfg)
        _randomize_constants(model)
        # Drawn after the model's weights, so those stay the same with or without MTP.
        mtp = mtp_state_dict(family, hf_cfg)
        _randomize_mtp_constants(mtp)
    sd = {**model.state_dict(), **mtp}
    if cfg.get("tie_word_embeddings") or cfg.get("text_config", {}).get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    return _to_hub_layout(family, sd)


def _dump_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tiny_checkpoint(
    family: str,
    out_dir: str | Path,
    seed: int = 0,
    quantization: str | None = None,
    reference_dir: str | Path | None = None,
    generation_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write a complete tiny HF checkpoint folder for `family` into `out_dir` and return it.

    overrides: `text_config={...}` / `vision_config={...}` merge into those sub-configs; any
    other key is set at the top level of config.json (e.g. `tie_word_embeddings=True`), except:
    `rope_scaling={...}` merges into the text rope parameters (e.g. YaRN, any family), and
    `mtp_num_hidden_layers=N` adds N MTP layers' `mtp.*` weights (Qwen3.5 families).
    `quantization="fp8_block"`: the weights as the -FP8 releases store them
    (tiny_checkpoint_fp8.py); `reference_dir` then also gets their dequantized 16-bit copy.
    generation_config: keys merged over the default generation_config.json (eos ids,
    do_sample=false); a key given as None is removed.
    """
    if quantization not in (None, "fp8_block"):
        raise ValueError(f"quantization must be None or 'fp8_block', got {quantization!r}")
    if reference_dir is not None and quantization is None:
        raise ValueError("reference_dir is the dequantized copy of a quantized checkpoint")
    cfg = build_config_dict(family, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = build_state_dict(family, cfg, seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _dump_json(out / "config.json", cfg)
    write_processing_files(out, cfg)
    if generation_config is not None:
        _write_generation_config(out, generation_config)
    if quantization is not None:
        from .tiny_checkpoint_fp8 import convert_checkpoint_fp8_block

        convert_checkpoint_fp8_block(out, out, reference_dir)
    return out


def _write_generation_config(out: Path, changes: dict[str, Any]) -> None:
    path = out / "generation_config.json"
    merged = {**json.loads(path.read_text(encoding="utf-8")), **changes}
    _dump_json(path, {k: v for k, v in merged.items() if v is not None})


def _is_complete(folder: Path) -> bool:
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    needed = REQUIRED_FILES + (_VL_FILES if "vision_config" in cfg else ())
    return all((folder / name).is_file() and (folder / name).stat().st_size > 0 for name in needed)


def get_or_build_demo_checkpoint(
    family: str = "qwen2_vl", cache_dir: str | Path | None = None
) -> Path:
    """Build the demo checkpoint once into a cache folder and reuse it afterwards.

    The cache root is `cache_dir`, else $TLLM_QWENVL_CACHE, else ~/.cache/tensorrt_llm_qwenvl.
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; expected one of {TINY_FAMILIES}")
    root = Path(
        cache_dir
        or os.environ.get("TLLM_QWENVL_CACHE")
        or Path.home() / ".cache" / "tensorrt_llm_qwenvl"
    ).expanduser()
    target = root / f"demo-{family}-{_DEMO_VERSION}"
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: a crashed or concurrent build never leaves a
    # half-written folder at the final path.
    tmp = Path(tempfile.mkdtemp(prefix=f".demo-{family}-", dir=root))
    try:
        write_tiny_checkpoint(family, tmp, seed=0)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # a concurrent builder did not win either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
