"""The HF transformers baseline on the same workload, same GPU, same run.

HF `generate` runs the batch of `concurrency` requests (equal prompt lengths, so no padding) with
random weights at the same size. Its decode is slow, so it generates `osl` tokens only up to
`max_osl` and the throughput is taken from the decode rate: tokens / (time of N tokens - time of 1).
"""

from __future__ import annotations

import gc
import inspect
import time
from typing import Any

import torch
import transformers

from ..inputs.registry import create_input_processor


def build_hf_model(config: Any, dtype: torch.dtype, device: str) -> torch.nn.Module:
    arch = config.architectures[0]
    cls = getattr(transformers, arch)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype)
    return model.eval()


def _hf_inputs(
    model: torch.nn.Module, processor: Any, prompts: list[dict[str, Any]], device: str
) -> dict[str, Any]:
    ids, pixels, grids = [], [], []
    for prompt in prompts:
        tokens, extra = processor(prompt, None)
        ids.append(tokens)
        image = extra["multimodal_data"].get("image")
        if image is not None:
            pixels.append(image["pixel_values"])
            grids.append(image["image_grid_thw"])
    input_ids = torch.tensor(ids, device=device)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if pixels:  # text-only workloads (images_per_request 0) pass no vision inputs
        kwargs["pixel_values"] = torch.cat(pixels).to(device, model.dtype)
        kwargs["image_grid_thw"] = torch.cat(grids).to(device)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        kwargs["mm_token_type_ids"] = (input_ids == model.config.image_token_id).int()
    return kwargs


@torch.inference_mode()
def _generate_time(model: torch.nn.Module, kwargs: dict[str, Any], new_tokens: int) -> float:
    on_cuda = next(model.parameters()).device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if on_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_hf_baseline(
    model: torch.nn.Module,
    model_dir: str,
    prompts: list[dict[str, Any]],
    concurrency: int,
    max_osl: int,
    device: str = "cuda",
) -> dict[str, float]:
    processor = create_input_processor(model_dir)
    kwargs = _hf_inputs(model, processor, prompts[:concurrency], device)
    _generate_time(model, kwargs, 2)  # warm-up
    ttft = _generate_time(model, kwargs, 1)
    total = _generate_time(model, kwargs, max_osl)
    decode_step = (total - ttft) / max(max_osl - 1, 1)
    return {
        "concurrency": concurrency,
        "ttft_ms": ttft * 1e3,
        "itl_ms": decode_step * 1e3,
        "output_tok_s": concurrency / decode_step,
    }


def hf_device(device: str) -> str:
    """The HF baseline's device: `--device`, with "auto" meaning CUDA when there is one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def free_accelerator() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
