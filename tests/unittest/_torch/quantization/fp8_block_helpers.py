"""A tiny checkpoint on our CPU engine, for the block-FP8 tests: prefill logits and greedy
tokens of one request, float32 compute."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tensorrt_llm._torch.config_utils import load_pretrained_config, resolve_architecture
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.modules.fp8_block_model import apply_fp8_block_config_
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.quantization import resolve_quant_config
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.tools.tiny_checkpoint import build_config_dict, write_tiny_checkpoint
from tensorrt_llm.tools.tiny_checkpoint_fp8 import convert_checkpoint_fp8_block


def load_engine(
    ckpt: Path,
    quantization: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PyTorchModelEngine:
    """Our model from `ckpt` (block-FP8 as its config says, or as `quantization` asks)."""
    config = load_pretrained_config(ckpt)
    quant = resolve_quant_config(quantization, config)
    model = load_model(
        get_model_class(resolve_architecture(config)),
        ModelConfig(config, torch_dtype=dtype, max_num_seq_slots=4, checkpoint_dir=str(ckpt)),
        device,
        prepare=(lambda m: apply_fp8_block_config_(m, quant)) if quant is not None else None,
    )
    engine = PyTorchModelEngine(
        model,
        torch.device(device),
        max_num_tokens=256,
        max_batch_size=4,
        max_seq_len=256,
        tokens_per_block=16,
    )
    text = getattr(config, "text_config", None) or config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    engine.set_kv_cache_manager(
        KVCacheManager(
            text.num_hidden_layers,
            text.num_key_value_heads,
            head_dim,
            16,
            64,
            16,
            dtype=dtype,
            device=device,
        )
    )
    return engine


@torch.inference_mode()
def prefill_and_greedy(
    engine: PyTorchModelEngine, ckpt: Path, ids: list[int], steps: int
) -> tuple[torch.Tensor, list[int]]:
    """(prefill logits `[len(ids), vocab]`, `steps` greedy tokens) of one request."""
    proc = create_input_processor(str(ckpt))
    prompt_ids, extra = proc({"prompt_token_ids": list(ids)}, None)
    params = MultimodalParams(extra["multimodal_data"]) if extra else None
    req = LlmRequest(1, list(prompt_ids), multimodal_params=params)
    req.seq_slot = 0
    kv = engine.kv_cache_manager
    assert kv is not None and kv.add_tokens(1, len(prompt_ids) + steps + 1)
    req.context_chunk_size = req.prompt_len
    try:
        logits = engine.forward(ScheduledRequests([req], []), return_context_logits=True)
        tokens = [int(logits[-1].argmax())]
        for _ in range(steps - 1):
            req.add_new_token(tokens[-1])
            out = engine.forward(ScheduledRequests([], [req]))
            tokens.append(int(out[-1].argmax()))
    finally:
        kv.free(1)
    return logits.float(), tokens


def _text_only(src: Path, out: Path, config: dict[str, Any]) -> Path:
    """A text-only checkpoint from a VL one: its text weights under `model.*`, `config`."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    weights = load_file(str(src / "model.safetensors"))
    text = {}
    for name, t in weights.items():
        if name.startswith(("model.visual.", "visual.")):
            continue
        text[name.replace("model.language_model.", "model.", 1)] = t
    save_file(text, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def write_text_qwen3_5(root: Path) -> Path:
    """The text Qwen3.5 (`Qwen3_5ForCausalLM`): the tiny qwen3_5 checkpoint's text stack."""
    src = write_tiny_checkpoint("qwen3_5", root / "qwen3_5_vl_src")
    text = json.loads((src / "config.json").read_text())["text_config"]
    text.update(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text")
    return _text_only(src, root / "qwen3_5_text_src", text)


def write_qwen3_moe(root: Path) -> Path:
    """A plain Qwen3-MoE: the tiny qwen3_vl_moe text stack with 1-D RoPE."""
    src = write_tiny_checkpoint("qwen3_vl_moe", root / "qwen3_vl_moe_src")
    text = json.loads((src / "config.json").read_text())["text_config"]
    text.pop("rope_parameters", None)
    text.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return _text_only(src, root / "qwen3_moe_src", text)


def write_pair(family: str, root: Path) -> tuple[Path, Path]:
    """(block-FP8 checkpoint, its dequantized 16-bit reference) of a tiny `family`; also the
    text-only "qwen3_5_text" and "qwen3_moe" built from the VL ones, and "qwen3_5_moe_fused"
    (Qwen3.5-MoE with the shared expert fused, as Qwen3.6-35B-A3B's)."""
    fp8, ref = root / f"{family}-fp8", root / f"{family}-ref"
    if family == "qwen3_5_text":
        convert_checkpoint_fp8_block(write_text_qwen3_5(root), fp8, ref)
    elif family == "qwen3_moe":
        convert_checkpoint_fp8_block(write_qwen3_moe(root), fp8, ref)
    elif family == "qwen3_5_moe_fused":  # shared expert as wide as the routed: it gets fused
        text = build_config_dict("qwen3_5_moe")["text_config"]
        same = {"shared_expert_intermediate_size": text["moe_intermediate_size"]}
        write_tiny_checkpoint("qwen3_5_moe", fp8, quantization="fp8_block", reference_dir=ref,
                              text_config=same)  # fmt: skip
    else:
        write_tiny_checkpoint(family, fp8, quantization="fp8_block", reference_dir=ref)
    return fp8, ref
