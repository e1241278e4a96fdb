"""End to end on CUDA: the fast path (Triton attention + decode CUDA graphs + overlap scheduler)
gives the same greedy tokens as the torch reference path (vanilla attention, eager), per family.

fp32 keeps both paths within rounding of each other, so greedy tokens agree exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.inputs.utils import VideoData
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen_image_bench",
)
IMAGE = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")


def _inputs() -> list:
    from PIL import Image

    frames = [Image.open(IMAGE).convert("RGB").resize((56, 56)) for _ in range(4)]
    return [
        "a text-only request about the weather",
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": "describe"}],
                }
            ],
            "multi_modal_data": {"image": [IMAGE]},
        },
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [{"type": "video"}, {"type": "text", "text": "what happens"}],
                }
            ],
            "multi_modal_data": {"video": [VideoData(frames=frames, fps=2.0)]},
        },
    ]


def _greedy(ckpt: Path, fast: bool) -> list[list[int]]:
    kwargs = (
        dict(attn_backend="triton")
        if fast
        else dict(attn_backend="vanilla", cuda_graph_config=None, disable_overlap_scheduler=True)
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(model=str(ckpt), device="cuda", dtype="float32", max_batch_size=4, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(_inputs(), params, use_tqdm=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_matches_reference_path(family: str, tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(family, tmp_path / family)
    assert _greedy(ckpt, fast=True) == _greedy(ckpt, fast=False)
