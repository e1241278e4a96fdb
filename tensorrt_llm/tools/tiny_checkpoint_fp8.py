"""Block-FP8 variants of tiny checkpoints, made the way the Qwen `-FP8` releases are.

From a 16-bit checkpoint folder, every linear the releases quantize (the text decoder's
attention, MLP, DeltaNet qkv/z/out and MoE expert projections) becomes an e4m3 `weight` plus an
fp32 `weight_scale_inv` per 128 x 128 block (amax / 448, `quantize_weight_fp8_block`); the
vision tower, routers, scalar gates, DeltaNet beta/alpha projections, embeddings, norms and the
LM head stay 16-bit, and config.json gets a `quantization_config` whose
`modules_to_not_convert` lists them as the releases do (the tower by its prefix, the LM head,
the per-layer gates by their full names). MoE experts are written per expert, as the releases
store them.

The reference: the same checkpoint with every quantized weight replaced by its dequantized
value (`weight * scale_inv`, in the original dtype), which a 16-bit model loads exactly.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .._torch.modules.triton_kernels.fp8_block import (
    BLOCK_SIZE,
    dequantize_weight_fp8_block,
    quantize_weight_fp8_block,
)
from .._torch.quantization import QuantConfig

# HF projection names the releases quantize (outside the vision tower).
QUANTIZED_LEAVES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    | {"in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj"}
)
_VISION_PREFIXES = ("model.visual.", "visual.")
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _per_expert(weights: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors (transformers 5 `[E, 2I, H]` / `[E, H, I]`, or the Qwen3-VL-MoE
    hub's transposed `[E, H, 2I]` / `[E, I, H]`) as per-expert `experts.N.*_proj.weight`."""
    text = cfg.get("text_config", cfg)
    hidden, inter = text.get("hidden_size"), text.get("moe_intermediate_size")
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        m = _STACKED_EXPERTS.match(name)
        if m is None:
            out[name] = t
            continue
        if m["proj"] == "gate_up_proj":
            if t.shape[1] == hidden and t.shape[2] == 2 * inter:
                t = t.transpose(1, 2)
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{m['prefix']}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{m['prefix']}.{e}.up_proj.weight"] = up.contiguous()
        else:
            if t.shape[1] == inter and t.shape[2] == hidden:
                t = t.transpose(1, 2)
            for e in range(t.shape[0]):
                out[f"{m['prefix']}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def is_release_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether the releases store checkpoint tensor `name` in block FP8."""
    if not name.endswith(".weight") or tensor.dim() != 2 or name.startswith(_VISION_PREFIXES):
        return False
    return name[: -len(".weight")].rpartition(".")[2] in QUANTIZED_LEAVES


def _not_converted(weights: dict[str, torch.Tensor]) -> list[str]:
    """The release-style modules_to_not_convert: the tower's prefix, the LM head, and every
    other 2-D weight of the decoder that is a projection (gates, beta/alpha) by full name."""
    skip: list[str] = sorted({p[:-1] for p in _VISION_PREFIXES for n in weights if n.startswith(p)})
    skip.append("lm_head")
    for name, t in sorted(weights.items()):
        module = name[: -len(".weight")]
        if (
            name.endswith(".weight")
            and t.dim() == 2
            and not name.startswith(_VISION_PREFIXES)
            and not is_release_quantized(name, t)
            and not module.endswith(("embed_tokens", "lm_head"))
        ):
            skip.append(module)
    return skip


def quantize_weights_fp8_block(
    weights: dict[str, torch.Tensor], cfg: dict[str, Any], block: tuple[int, int] = BLOCK_SIZE
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """(block-FP8 weights, dequantized 16-bit weights, quantization_config) of `weights`."""
    weights = _per_expert(weights, cfg)
    quant = QuantConfig(
        weight_block_size=block, modules_to_not_convert=tuple(_not_converted(weights))
    )
    fp8: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, t in sorted(weights.items()):
        module = name.rpartition(".")[0]
        if not is_release_quantized(name, t):
            fp8[name] = ref[name] = t
            if t.dim() == 2 and name.endswith(".weight") and not name.startswith(_VISION_PREFIXES):
                if "embed_tokens" not in name and quant.converts([module]):
                    raise AssertionError(f"{module} is 16-bit but not in modules_to_not_convert")
            continue
        if not quant.converts([module]):  # the writer and the loader's matcher must agree
            raise AssertionError(f"{module} is quantized but matches modules_to_not_convert")
        q, scale = quantize_weight_fp8_block(t, block)
        fp8[name] = q
        fp8[module + ".weight_scale_inv"] = scale
        ref[name] = dequantize_weight_fp8_block(q, scale, block).to(t.dtype)
    return fp8, ref, quant.to_dict()


def convert_checkpoint_fp8_block(
    src_dir: str | Path,
    out_dir: str | Path,
    reference_dir: str | Path | None = None,
    block: tuple[int, int] = BLOCK_SIZE,
) -> Path:
    """Write the block-FP8 variant of the 16-bit checkpoint folder `src_dir` to `out_dir` (may
    be the same folder) and, if given, its dequantized 16-bit twin to `reference_dir`."""
    src, out = Path(src_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in cfg or "quantization_config" in cfg.get("text_config", {}):
        raise ValueError(f"{src} is already quantized")
    weights = load_file(str(src / "model.safetensors"))
    fp8, ref, quant = quantize_weights_fp8_block(weights, cfg, block)
    for folder, tensors, config in (
        (reference_dir, ref, cfg),
        (out, fp8, {**cfg, "quantization_config": quant}),
    ):
        if folder is None:
            continue
        folder = Path(folder)
        if folder.resolve() != src.resolve():
            shutil.copytree(src, folder, dirs_exist_ok=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        (folder / "config.json").write_text(text, encoding="utf-8")
    return out
