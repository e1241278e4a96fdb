"""Time the vectorised Qwen-VL get_rope_index against transformers' on one large prompt.

The prompt holds 4 images of 1024 vision tokens each (grid 1x64x64, merge 2) and 2000 text tokens,
so about 6100 tokens. Both implementations run on the same input in the same process; the table
gives the median over repeats, in milliseconds, and the speed-up.

    python benchmarks/bench_rope_index.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from tensorrt_llm._torch.models.qwen_vl_rope_index import (
    Qwen2_5VLRopeIndexMixin,
    Qwen2VLRopeIndexMixin,
    Qwen3VLRopeIndexMixin,
)

NUM_IMAGES = 4
IMAGE_GRID = (1, 64, 64)  # 32x32 = 1024 vision tokens after the 2x2 merge
NUM_TEXT = 2000

FAMILIES = [
    ("qwen2_vl", Qwen2VLConfig, Qwen2VLModel, Qwen2VLRopeIndexMixin),
    ("qwen2_5_vl", Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2_5VLRopeIndexMixin),
    ("qwen3_vl", Qwen3VLConfig, Qwen3VLModel, Qwen3VLRopeIndexMixin),
]


def build_prompt(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, S] ids: text runs around 4 image blocks; text ids stay below the special ids."""
    merge = config.vision_config.spatial_merge_size
    per_image = IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2] // merge**2
    text_runs = [NUM_TEXT // (NUM_IMAGES + 1)] * NUM_IMAGES
    text_runs.append(NUM_TEXT - sum(text_runs))
    generator = torch.Generator().manual_seed(0)
    pieces: list[torch.Tensor] = []
    for i, run in enumerate(text_runs):
        pieces.append(torch.randint(0, 1000, (run,), generator=generator))
        if i < NUM_IMAGES:
            block = [config.vision_start_token_id] + [config.image_token_id] * per_image
            pieces.append(torch.tensor(block + [config.vision_end_token_id]))
    ids = torch.cat(pieces).view(1, -1)
    grids = torch.tensor([IMAGE_GRID] * NUM_IMAGES, dtype=torch.int64)
    return ids, grids


def hf_call(model_cls: Any, config: Any, ids: torch.Tensor, grids: torch.Tensor) -> Callable:
    """transformers' method bound to a stand-in object; token types built outside the timing."""
    shim = types.SimpleNamespace(config=config)
    shim.get_vision_position_ids = types.MethodType(model_cls.get_vision_position_ids, shim)
    token_types = (ids == config.image_token_id).int()
    return lambda: model_cls.get_rope_index(shim, ids, token_types, grids)


def ours_call(mixin: Any, config: Any, ids: torch.Tensor, grids: torch.Tensor) -> Callable:
    return lambda: mixin.get_rope_index(config, ids, grids)


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)

    print(
        f"prompt: {NUM_IMAGES} images x 1024 vision tokens + {NUM_TEXT} text tokens, "
        f"median of {args.repeats} runs, 1 CPU thread, torch {torch.__version__}"
    )
    print("| family | tokens | ours (ms) | transformers (ms) | speed-up |")
    print("|---|---|---|---|---|")
    for name, config_cls, model_cls, mixin in FAMILIES:
        config = config_cls()
        ids, grids = build_prompt(config)
        ours = ours_call(mixin, config, ids, grids)
        reference = hf_call(model_cls, config, ids, grids)
        ours_pos, ours_delta = ours()
        ref_pos, ref_delta = reference()
        if not (torch.equal(ours_pos, ref_pos) and torch.equal(ours_delta, ref_delta.long())):
            raise SystemExit(f"{name}: outputs differ from transformers")
        ours_ms = median_ms(ours, args.repeats)
        ref_ms = median_ms(reference, args.repeats)
        print(
            f"| {name} | {ids.shape[1]} | {ours_ms:.3f} | {ref_ms:.3f} | {ref_ms / ours_ms:.1f}x |"
        )


if __name__ == "__main__":
    main()
