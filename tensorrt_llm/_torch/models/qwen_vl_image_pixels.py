"""One RGB image -> Qwen-VL patches, bit for bit as HF's PIL image processor computes them.

HF's Qwen2-VL PIL processor (`Qwen2VLImageProcessorPil`, the class this project loads without
torchvision) resizes with PIL, converts the uint8 pixels to float, rescales in float64, casts
to float32, normalises per channel, repeats the image `temporal_patch_size` times and then
transposes the float array into patch order: 3.1 ms for a 512x512 image at Qwen3-VL's
settings on the dev CPU, run for every image request before the engine sees it (in the
caller's thread in process, in the preprocess workers of trtllm-serve).

Rescale and normalise are elementwise functions of one uint8 level and its channel, so here
they become one 256-entry float32 table per channel (the same float64-then-float32 products,
the same float32 subtraction and division, so the same bits), and the patch transpose runs on
the uint8 pixels (a quarter of the bytes, and one frame instead of `temporal_patch_size`):
the table lookup writes the float patches once, into both temporal slots: 1.4 ms for the
same image (`benchmarks/bench_image_processor.py`). The PIL resize, where the size changes,
is the same call in both and dominates large images.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:  # qwen_vl_media imports this module
    from .qwen_vl_media import VisionPreprocessConfig


@lru_cache(maxsize=16)
def _level_tables(
    rescale: float | None, mean: tuple[float, ...] | None, std: tuple[float, ...] | None
) -> np.ndarray:
    """float32 [3, 256]: each channel's output for each uint8 level."""
    levels = np.arange(256)
    if rescale is None:
        base = levels.astype(np.float32)
    else:  # float64 product then float32: the HF rescale's rounding
        base = (levels.astype(np.float64) * rescale).astype(np.float32)
    if mean is None or std is None:
        return np.stack([base] * 3)
    m, s = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return np.stack([(base - m[c]) / s[c] for c in range(3)])


def image_patches(
    image: Image.Image, size: tuple[int, int], cfg: VisionPreprocessConfig
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An RGB image resized to `size` (height, width), as (float32 [N, C*tp*p*p], (1, h, w))
    in HF's patch order (h-block, w-block, h-in-merge, w-in-merge), (C, t, ph, pw) inside."""
    height, width = size
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"image size {width}x{height} is not a multiple of {p * m}")
    if image.size != (width, height):
        image = image.resize((width, height), resample=cfg.resample)
    pixels = np.asarray(image.convert("RGB"))  # uint8 [H, W, 3]
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, 3)
    # -> (h-block, w-block, h-in-merge, w-in-merge, C, ph, pw): the uint8 pixels in patch order
    blocks = np.ascontiguousarray(blocks.transpose(0, 3, 1, 4, 6, 2, 5))
    blocks = blocks.reshape(grid_h * grid_w, 3, p * p)
    tables = _level_tables(
        cfg.rescale_factor if cfg.do_rescale else None,
        tuple(cfg.image_mean) if cfg.do_normalize else None,
        tuple(cfg.image_std) if cfg.do_normalize else None,
    )
    patches = np.empty((grid_h * grid_w, 3, tp, p * p), dtype=np.float32)
    for c in range(3):
        # One lookup per pixel, broadcast into every temporal slot (the repeated image).
        patches[:, c] = tables[c][blocks[:, c]][:, None, :]
    return torch.from_numpy(patches.reshape(grid_h * grid_w, -1)), (1, grid_h, grid_w)
