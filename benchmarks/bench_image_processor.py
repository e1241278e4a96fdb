"""Host time of one image request's pixels: HF's PIL Qwen2-VL image processor against ours.

    python benchmarks/bench_image_processor.py [--sizes 512x512 1024x768] [--output FILE]

This is CPU work on the request path (the caller's thread in process, a preprocess worker
in trtllm-serve), so the CPU figure is the figure. For each image size (random RGB pixels,
Qwen2-VL and Qwen3-VL processor settings): the mean time of the HF call the input processor
made before (`Qwen2VLImageProcessorPil(images=[image], return_tensors="pt")`) and of
`preprocess_images` (`qwen_vl_image_pixels`), after checking that both give the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from tensorrt_llm._torch.models.qwen_vl_media import VisionPreprocessConfig, preprocess_images

SETTINGS = {
    "qwen2_vl": {},
    "qwen3_vl": {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
}


def mean_ms(fn: Callable[[], object], iters: int) -> float:
    # NOTE: HF's first ~30 calls run ~2.5x slower (its large float64 temporaries keep
    # mapping fresh pages until the allocator settles): time the steady state.
    for _ in range(40):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["512x512", "1024x768", "1920x1080"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--output", help="write the figures as JSON here")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for name, kwargs in SETTINGS.items():
        hf = Qwen2VLImageProcessorPil(**kwargs)
        cfg = VisionPreprocessConfig.from_mapping(hf)
        size = {"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels}
        for spec in args.sizes:
            width, height = (int(v) for v in spec.split("x"))
            image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
            hf_call = partial(hf, images=[image], do_resize=True, size=size, return_tensors="pt")
            ours_call = partial(preprocess_images, [image], cfg)
            want, (pixels, grid) = hf_call(), ours_call()
            same = torch.equal(pixels, want["pixel_values"])
            if not (same and torch.equal(grid, want["image_grid_thw"])):
                raise SystemExit(f"{name} {spec}: our pixels differ from the HF processor's")
            row = {
                "settings": name,
                "image": spec,
                "patches": int(pixels.shape[0]),
                "hf_ms": mean_ms(hf_call, args.iters),
                "ours_ms": mean_ms(ours_call, args.iters),
            }
            row["speedup"] = row["hf_ms"] / row["ours_ms"]
            print(f"{name:9s} {spec:>10s} ({row['patches']:5d} patches): HF "
                  f"{row['hf_ms']:7.2f} ms, ours {row['ours_ms']:6.2f} ms, "
                  f"{row['speedup']:.1f}x", flush=True)  # fmt: skip
            rows.append(row)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
