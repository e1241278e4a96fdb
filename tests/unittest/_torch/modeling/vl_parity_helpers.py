"""Helpers for HF-parity tests of the VL models: our engine path vs the HF reference model."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image

from tensorrt_llm._torch.config_utils import load_pretrained_config, resolve_architecture
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.inputs.utils import VideoData

HF_CLASS = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


def image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def video(num_frames: int = 2, h: int = 56, w: int = 56) -> VideoData:
    return VideoData(frames=[image(h, w, seed=50 + i) for i in range(num_frames)], fps=2.0)


def prompt(kind: str) -> dict[str, Any]:
    """The parity prompts: one image, two images of different sizes, a video, text only."""
    parts: list[dict[str, Any]] = []
    media: dict[str, list[Any]] = {}
    if kind == "image":
        media["image"] = [image(60, 84)]
    elif kind == "two_images":
        media["image"] = [image(56, 56, seed=1), image(84, 112, seed=2)]
    elif kind == "video":
        media["video"] = [video()]
    for name, items in media.items():
        parts += [{"type": name} for _ in items]
    parts.append({"type": "text", "text": "What is shown here?"})
    return {"prompt": [{"role": "user", "content": parts}], "multi_modal_data": media}


@dataclass
class Stack:
    """Our engine and the HF model for one tiny checkpoint."""

    family: str
    processor: Any
    engine: PyTorchModelEngine
    kv: KVCacheManager
    slots: SeqSlotManager
    hf: torch.nn.Module


def build_stack(
    family: str,
    ckpt: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    hf_class: str | None = None,
) -> Stack:
    config = load_pretrained_config(ckpt)
    cls = get_model_class(resolve_architecture(config))
    model_config = ModelConfig(
        config, torch_dtype=dtype, max_num_seq_slots=8, checkpoint_dir=str(ckpt)
    )
    model = load_model(cls, model_config, device)
    engine = PyTorchModelEngine(
        model,
        torch.device(device),
        max_num_tokens=1024,
        max_batch_size=8,
        max_seq_len=1024,
        tokens_per_block=16,
    )
    text = config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = KVCacheManager(
        text.num_hidden_layers,
        text.num_key_value_heads,
        head_dim,
        16,
        256,
        64,
        dtype=dtype,
        device=device,
    )
    engine.set_kv_cache_manager(kv)
    hf_cls = getattr(transformers, hf_class or HF_CLASS[family])
    hf = hf_cls.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    return Stack(family, create_input_processor(ckpt), engine, kv, SeqSlotManager(8), hf)


def make_request(stack: Stack, request_id: int, inputs: dict[str, Any]) -> LlmRequest:
    ids, extra = stack.processor(inputs, None)
    req = LlmRequest(request_id, ids, multimodal_params=MultimodalParams(extra["multimodal_data"]))
    req.hf_inputs = extra["multimodal_data"]  # type: ignore[attr-defined]
    return req


def admit(stack: Stack, req: LlmRequest, extra_tokens: int = 16) -> None:
    req.seq_slot = stack.slots.acquire(req.request_id)
    assert stack.kv.add_tokens(req.request_id, req.prompt_len + extra_tokens)


def release(stack: Stack, req: LlmRequest) -> None:
    stack.kv.free(req.request_id)
    stack.slots.release(req.request_id)


def hf_kwargs(hf: torch.nn.Module, ids: list[int], data: dict[str, Any]) -> dict[str, Any]:
    """HF forward inputs for a full (uncached) pass over `ids`."""
    kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    image_data = data.get("image", {})
    video_data = data.get("video", {})
    if image_data:
        kwargs["pixel_values"] = image_data["pixel_values"].float().cpu()
        kwargs["image_grid_thw"] = image_data["image_grid_thw"].cpu()
    if video_data:
        kwargs["pixel_values_videos"] = video_data["pixel_values_videos"].float().cpu()
        kwargs["video_grid_thw"] = video_data["video_grid_thw"].cpu()
        if "second_per_grid_ts" in video_data:
            kwargs["second_per_grid_ts"] = torch.as_tensor(video_data["second_per_grid_ts"])
    params = inspect.signature(hf.forward).parameters
    if "mm_token_type_ids" in params:
        # transformers >= 5.2x locates vision blocks from token types instead of ids.
        cfg = hf.config
        types = torch.zeros(1, len(ids), dtype=torch.int32)
        ids_t = kwargs["input_ids"]
        types[ids_t == cfg.image_token_id] = 1
        types[ids_t == cfg.video_token_id] = 2
        kwargs["mm_token_type_ids"] = types
    return kwargs


@torch.inference_mode()
def hf_logits(stack: Stack, ids: list[int], data: dict[str, Any]) -> torch.Tensor:
    return stack.hf(**hf_kwargs(stack.hf, ids, data)).logits[0].float()


@torch.inference_mode()
def our_prefill(stack: Stack, req: LlmRequest, chunk: int | None = None) -> torch.Tensor:
    """Prefill (optionally in chunks); returns the logits of the last prompt token."""
    logits = None
    while req.is_context_init:
        req.context_chunk_size = min(chunk or req.prompt_len, req.context_remaining_length)
        last = req.is_last_context_chunk
        out = stack.engine.forward(ScheduledRequests([req], []))
        if last:
            logits = out[-1]
            break
        req.move_to_next_context_chunk()
    assert logits is not None
    return logits.float()


def our_decode(stack: Stack, reqs: list[LlmRequest]) -> torch.Tensor:
    return stack.engine.forward(ScheduledRequests([], reqs)).float()
