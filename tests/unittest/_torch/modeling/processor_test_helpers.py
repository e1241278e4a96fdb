"""Shared inputs of the input-processor tests (families, deterministic images and frames)."""

from __future__ import annotations

import numpy as np
from PIL import Image

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
TIMED = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")  # families whose videos need fps/timestamps


def image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def frames(n: int, h: int = 60, w: int = 70) -> list[Image.Image]:
    return [image(h, w, seed=10 + i) for i in range(n)]
