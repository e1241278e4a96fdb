"""Pixels cross to the engine in its patch-embedding dtype: fewer bytes, the same model output."""

from __future__ import annotations

import torch

from tensorrt_llm._torch.models.modeling_qwen_vision_common import PatchEmbed
from tensorrt_llm.executor.protocol import _patch_embed_dtype, narrow_pixels


def test_only_pixel_tensors_are_cast_and_the_input_is_untouched() -> None:
    pixels, video = torch.rand(8, 12), torch.rand(4, 12)
    grid = torch.tensor([[1, 2, 4]])
    data = {
        "image": {"pixel_values": pixels, "image_grid_thw": grid},
        "video": {"pixel_values_videos": video, "video_grid_thw": grid},
        "mrope_config": {"mrope_position_deltas": torch.zeros(1, 1)},
    }
    out = narrow_pixels(data, torch.bfloat16)
    assert out["image"]["pixel_values"].dtype == torch.bfloat16
    assert out["video"]["pixel_values_videos"].dtype == torch.bfloat16
    assert out["image"]["image_grid_thw"] is grid and out["mrope_config"] is data["mrope_config"]
    assert data["image"]["pixel_values"] is pixels and pixels.dtype == torch.float32
    assert narrow_pixels(data, None) is data


def test_narrowed_pixels_give_the_same_patch_embeddings() -> None:
    torch.manual_seed(0)
    embed = PatchEmbed(3, 2, 2, dim=16, bias=True, dtype=torch.bfloat16)
    assert _patch_embed_dtype(torch.nn.Sequential(embed)) == torch.bfloat16
    assert _patch_embed_dtype(torch.nn.Linear(2, 2)) is None
    pixels = torch.rand(5, embed.patch_dim)
    narrowed = narrow_pixels({"image": {"pixel_values": pixels}}, torch.bfloat16)
    assert torch.equal(embed(narrowed["image"]["pixel_values"]), embed(pixels))
