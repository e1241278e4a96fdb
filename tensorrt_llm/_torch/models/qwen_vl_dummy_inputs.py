"""Deterministic dummy inputs for the startup capacity probe (text-only and one-image prompts).

A mixin of the Qwen-VL input processors: it needs `tokenizer`, `vision_config`, `patch_size`,
`merge_size`, `min_pixels`, `max_pixels` and `default_multimodal_prompt` from the processor.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from PIL import Image

from ...inputs.data import TextPrompt
from ...inputs.registry import dummy_text_ids
from .qwen_vl_media import VisionPreprocessConfig, target_size


class QwenVLDummyInputsMixin:
    """Sizes and builds the probe's dummy requests."""

    # What the processor provides (set in its __init__); annotations only, no class values.
    tokenizer: Any
    vision_config: VisionPreprocessConfig
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    if TYPE_CHECKING:  # the processor's own method: the mixin adds none at run time

        def default_multimodal_prompt(self, question: str) -> str: ...

    def get_num_tokens_per_image(self, width: int, height: int) -> int:
        """Vision tokens one image of this size becomes (after resizing)."""
        new_h, new_w = target_size(height, width, self.vision_config)
        return (new_h // self.patch_size) * (new_w // self.patch_size) // self.merge_size**2

    def get_dummy_image_size(self, max_tokens: int) -> tuple[int, int]:
        """(width, height) of the largest square image whose tokens fit `max_tokens`.

        Deterministic, for the memory probe. Sides are multiples of patch_size * merge_size
        and never above max_pixels, so the image is used as it is.
        """
        factor = self.vision_config.factor
        units = min(math.isqrt(max(max_tokens, 0)), math.isqrt(self.max_pixels // factor**2))
        for side in range(units * factor, 0, -factor):
            if self.get_num_tokens_per_image(side, side) <= max_tokens:
                return side, side
        smallest = self.get_num_tokens_per_image(factor, factor)
        raise ValueError(
            f"max_tokens={max_tokens} is below the {smallest} tokens of the "
            f"smallest image (min_pixels={self.min_pixels})"
        )

    def get_dummy_prompt(self, num_tokens: int) -> list[int]:
        """`num_tokens` ids of ordinary text (a text-only dummy request)."""
        return dummy_text_ids(self.tokenizer, num_tokens)

    def get_dummy_multimodal_prompt(self, max_image_tokens: int) -> TextPrompt:
        """A one-image prompt with the largest gray image that fits `max_image_tokens`."""
        width, height = self.get_dummy_image_size(max_image_tokens)
        image = Image.new("RGB", (width, height), (128, 128, 128))
        return {
            "prompt": self.default_multimodal_prompt("Describe the image."),
            "multi_modal_data": {"image": [image]},
        }
