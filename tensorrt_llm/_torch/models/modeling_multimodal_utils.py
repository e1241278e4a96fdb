"""Shared multimodal plumbing for the Qwen-VL models: device-path lists."""

from __future__ import annotations

from ...inputs.multimodal import MROPE_POSITION_DELTAS, MROPE_POSITION_IDS

# NOTE: every mRoPE model class builds `multimodal_data_device_paths` from this constant
# (through `compose_device_paths`), so no class can forget the mRoPE keys. Upstream forgot
# them once and text-only startup crashed in `index_copy_` with a CPU delta.
MROPE_DEVICE_PATHS: tuple[str, ...] = (MROPE_POSITION_IDS, MROPE_POSITION_DELTAS)

# Pixels and precomputed embeddings go to the device; grid_thw tensors stay on the host
# because the vision tower reads them there to build its index tables.
VISION_DEVICE_PATHS: tuple[str, ...] = (
    "image.pixel_values",
    "video.pixel_values_videos",
    "multimodal_embedding",
)


def compose_device_paths(*groups: tuple[str, ...] | list[str]) -> list[str]:
    """Concatenate path groups, always appending the mRoPE keys, without duplicates."""
    paths: list[str] = []
    for group in (*groups, MROPE_DEVICE_PATHS):
        for path in group:
            if path not in paths:
                paths.append(path)
    return paths
