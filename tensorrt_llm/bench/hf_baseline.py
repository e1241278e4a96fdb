"""The HF transformers baseline on the same workload, same GPU, same run.

HF `generate` runs the batch of `concurrency` requests (equal prompt lengths, so no padding) with
random weights at the same size. Its decode is slow, so it generates `osl` tokens only up to
`max_osl` and the throughput is taken from the decode rate: a stopping criterion stamps the
time of every token, TTFT is the first stamp and the decode step the mean gap after it.
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


class _StepClock(transformers.StoppingCriteria):
    """Stamps the time after every generated token; never stops generation itself."""

    def __init__(self, on_cuda: bool) -> None:
        self.on_cuda = on_cuda
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.on_cuda:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def _generate_stamps(
    model: torch.nn.Module, kwargs: dict[str, Any], new_tokens: int
) -> tuple[float, list[float]]:
    """The start time and the time of every token of one generate call."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    clock = _StepClock(on_cuda)
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        **kwargs,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        stopping_criteria=transformers.StoppingCriteriaList([clock]),
    )
    return start, clock.stamps


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
    _generate_stamps(model, kwargs, 2)  # warm-up
    # One call with a stamp per token: TTFT and the decode step come from the same run, so
    # the decode step cannot go negative the way "time of N tokens - time of 1 token" from two
    # runs did on a busy CPU.
    start, stamps = _generate_stamps(model, kwargs, max(max_osl, 2))
    ttft = stamps[0] - start
    decode_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
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
