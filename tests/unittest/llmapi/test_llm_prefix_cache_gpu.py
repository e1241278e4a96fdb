"""Prefix caching on CUDA: the Triton attention backend, decode and piecewise CUDA graphs.

The CPU tests (`test_llm_prefix_cache.py`) cover the policy; this runs the same hits through
the GPU path: a cached prefix is read from the paged cache by the prefill kernel and the image
rows come from the vision-embedding cache or are skipped. Outputs must equal an engine with
reuse off, in float32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

TPB = 16
TEXT = "the quick brown fox jumps over the lazy dog and keeps on running far away " * 3


def _image(seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (56, 84, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _llm(reuse: bool) -> LLM:
    return LLM(
        str(get_or_build_demo_checkpoint("qwen2_vl")),
        device="cuda",
        dtype="float32",
        executor_mode="inproc",
        max_batch_size=8,
        max_seq_len=512,
        tokens_per_block=TPB,
        kv_cache_config={"enable_block_reuse": reuse, "max_tokens": 8192},
    )


def _prompts(llm: LLM) -> list[Any]:
    image = llm.input_processor.default_multimodal_prompt("Describe it. " + TEXT, num_images=1)
    return [TEXT, {"prompt": image, "multi_modal_data": {"image": [_image(0)]}}]


@pytest.mark.gpu
def test_hits_on_cuda_match_reuse_off() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with _llm(False) as off:
        want = [list(o.outputs[0].token_ids) for o in off.generate(_prompts(off), params)]
    with _llm(True) as on:
        engine = on._executor.model_engine
        assert engine.cuda_graph_runner is not None and engine.piecewise_graph_runner is not None
        first = on.generate(_prompts(on), params)
        again = on.generate(_prompts(on), params)
        # A batch of repeats at once: their hits are read together by one prefill step.
        batch = on.generate(_prompts(on) * 3, params)
    for i, out in enumerate((*first, *again, *batch)):  # every list alternates text, image
        assert list(out.outputs[0].token_ids) == want[i % 2], i
    assert [o.num_cached_tokens for o in first] == [0, 0]
    for out in (*again, *batch):
        assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // TPB * TPB > 0
