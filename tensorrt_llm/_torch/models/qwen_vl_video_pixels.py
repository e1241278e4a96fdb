"""Video frames -> normalised pixels exactly as the HF Qwen-VL video processors compute them.

HF's video processors work on torch tensors (through torchvision), not on PIL images like the
image processors, so a resized frame differs from a PIL bicubic resize by a level here and
there, and the logits drift. This module repeats their sequence with torch alone:

1. the RGB frame as a uint8 [C, H, W] tensor (channels first, contiguous);
2. resize with bicubic interpolation, antialias on, align_corners off. On the CPU
   torchvision hands a uint8 tensor straight to `torch.nn.functional.interpolate` (its native
   uint8 kernel, which rounds and saturates internally); elsewhere it computes in float32,
   clamps to [0, 255], rounds half to even and casts back to uint8;
3. rescale and normalise fused, in float32: (x - mean / rescale_factor) / (std /
   rescale_factor), which is what the HF processors do when both steps are on.

Images keep the PIL path of `qwen_vl_media`: it is what the HF image processors use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:  # qwen_vl_media imports this module
    from .qwen_vl_media import VisionPreprocessConfig


def resize_uint8(frame: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic antialiased resize of a uint8 [N, C, H, W] tensor to `size` = (height, width)."""
    if tuple(frame.shape[-2:]) == tuple(size):
        return frame
    kwargs: dict[str, Any] = {
        "size": list(size),
        "mode": "bicubic",
        "antialias": True,
        "align_corners": False,
    }
    if frame.device.type == "cpu":
        return torch.nn.functional.interpolate(frame, **kwargs)
    out = torch.nn.functional.interpolate(frame.to(torch.float32), **kwargs)
    return out.clamp_(0, 255).round_().to(torch.uint8)


def normalize_video(frames: torch.Tensor, cfg: VisionPreprocessConfig) -> torch.Tensor:
    """uint8 [N, C, H, W] -> float32, rescaled and normalised the way HF fuses the two."""
    x = frames.to(torch.float32)
    if cfg.do_normalize:
        mean = torch.tensor(cfg.image_mean, dtype=torch.float32)
        std = torch.tensor(cfg.image_std, dtype=torch.float32)
        if cfg.do_rescale:  # fused: one subtract and one divide on the 0..255 values
            mean, std = mean * (1.0 / cfg.rescale_factor), std * (1.0 / cfg.rescale_factor)
        return x.sub_(mean.view(1, -1, 1, 1)).div_(std.view(1, -1, 1, 1))
    return x * cfg.rescale_factor if cfg.do_rescale else x


def video_frame_to_array(
    image: Image.Image, size: tuple[int, int], cfg: VisionPreprocessConfig
) -> np.ndarray:
    """One RGB video frame -> float32 [C, H, W] at `size` = (height, width)."""
    pixels = np.array(image.convert("RGB"), dtype=np.uint8)  # a writable copy for torch
    frame = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)
    frame = resize_uint8(frame.contiguous(), size)
    return normalize_video(frame, cfg)[0].numpy()
