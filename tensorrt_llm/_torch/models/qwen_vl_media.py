"""Qwen-VL pixel preprocessing for videos (and images), without torchvision.

The HF video processors need torchvision, which this project does not depend on, so videos are
patchified here: resize (smart-resize; video frames with HF's video-processor torch resize, see
`qwen_vl_video_pixels`, images with PIL bicubic) -> rescale -> normalise -> group
`temporal_patch_size` frames (repeating the last frame to fill the final group) -> flatten to
[N_patches, C * temporal_patch_size * patch_size**2] in the HF patch order
(t, h-block, w-block, h-in-merge, w-in-merge) with (C, t, ph, pw) inside a patch.
An image is the one-frame case; its output equals the HF image processor's (tested), and
`preprocess_images` computes it faster from the uint8 pixels (`qwen_vl_image_pixels`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ...inputs.validation import check_mm_processor_kwargs
from .qwen_vl_image_pixels import image_patches
from .qwen_vl_video_pixels import video_frame_to_array

# Frame sampling lives in its own module; re-exported because the input processors and tests
# import it from here.
from .qwen_vl_video_sampling import (  # noqa: F401
    VideoSampling,
    group_timestamps,
    sample_indices_qwen2,
    sample_indices_qwen3,
    select_video_frames,
)

# Defaults of the HF Qwen2-VL image processor (OpenAI CLIP statistics).
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MAX_ASPECT_RATIO = 200
# preprocessor_config.json keys the fallback image-processor construction passes on.
_IMAGE_PROCESSOR_KEYS = (
    "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
    "image_mean", "image_std", "do_resize", "do_rescale", "do_normalize",
)  # fmt: skip


def read_json(path: Path) -> dict[str, Any] | None:
    """A json file's content, or None when the file does not exist."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def load_image_processor(model_path: str, trust_remote_code: bool = False) -> Any:
    """The checkpoint's HF image processor from local files only (never the hub).

    Falls back to the PIL Qwen2-VL class built from preprocessor_config.json when
    AutoImageProcessor cannot load (for example, a processor class that needs torchvision).
    """
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(
            model_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # a missing backend or an unknown class name: use the json
        cfg = read_json(Path(model_path) / "preprocessor_config.json")
        if cfg is None:
            raise ValueError(f"no preprocessor_config.json in {model_path}") from exc
        # Either class: declared so the fallback import may bind the other one.
        processor_cls: type[Any]
        try:
            from transformers import Qwen2VLImageProcessorPil as processor_cls
        except ImportError:  # older transformers: the slow class is the PIL one
            from transformers import Qwen2VLImageProcessor as processor_cls
        return processor_cls(**{k: cfg[k] for k in _IMAGE_PROCESSOR_KEYS if k in cfg})


def pil_image_processor_class() -> type[Any]:
    """The HF Qwen2-VL image processor whose pipeline `preprocess_images` repeats bit for bit:
    the PIL one (`Qwen2VLImageProcessorPil`; in older transformers the slow class is it)."""
    try:
        from transformers import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil
    except ImportError:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor


def _size_value(size: Any, key: str) -> int | None:
    if size is None:
        return None
    value = size.get(key) if isinstance(size, Mapping) else getattr(size, key, None)
    return None if value is None else int(value)


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """Pixel pipeline settings, read once from an image processor or a processor config.

    `budget_over_frames`: Qwen3-VL video resizing spends `max_pixels` on the whole clip
    (frames rounded to the temporal patch) instead of on each frame.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)
    budget_over_frames: bool = False

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (one merged vision token per factor**2)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any] | Any, **extra: Any) -> VisionPreprocessConfig:
        """Build from a preprocessor_config.json dict or an HF image processor object."""

        def get(key: str) -> Any:
            return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)

        size = get("size")
        values: dict[str, Any] = {}
        min_pixels = _size_value(size, "shortest_edge") or get("min_pixels")
        max_pixels = _size_value(size, "longest_edge") or get("max_pixels")
        if min_pixels is not None:
            values["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            values["max_pixels"] = int(max_pixels)
        for key in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if get(key) is not None:
                values[key] = int(get(key))
        for key in ("do_resize", "do_rescale", "do_normalize"):
            if get(key) is not None:
                values[key] = bool(get(key))
        if get("rescale_factor") is not None:
            values["rescale_factor"] = float(get("rescale_factor"))
        for key in ("image_mean", "image_std"):
            value = get(key)
            if value is not None:
                values[key] = tuple(float(v) for v in np.broadcast_to(np.asarray(value), (3,)))
        values.update(extra)
        return cls(**values)

    def with_overrides(self, overrides: Mapping[str, Any]) -> VisionPreprocessConfig:
        """Apply per-request `mm_processor_kwargs` (min_pixels, max_pixels, do_resize).

        Every known key is type- and range-checked first (the LLM API checked them already;
        a processor called directly gets the same errors).
        """
        overrides = check_mm_processor_kwargs(overrides)
        changes: dict[str, Any] = {
            k: overrides[k] for k in ("min_pixels", "max_pixels") if k in overrides
        }
        changes = {k: int(v) for k, v in changes.items()}
        if "do_resize" in overrides:
            changes["do_resize"] = bool(overrides["do_resize"])
        out = replace(self, **changes)
        if out.min_pixels > out.max_pixels:
            raise ValueError(f"min_pixels={out.min_pixels} exceeds max_pixels={out.max_pixels}")
        return out


def _check_aspect(height: int, width: int) -> None:
    if min(height, width) < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} exceeds "
            f"{_MAX_ASPECT_RATIO}"
        )


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with the area in [min, max] pixels.

    The aspect ratio is kept as closely as the rounding allows (the HF Qwen2-VL rule).
    """
    _check_aspect(height, width)
    new_h = round(height / factor) * factor
    new_w = round(width / factor) * factor
    if new_h * new_w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        new_h = max(factor, math.floor(height / scale / factor) * factor)
        new_w = max(factor, math.floor(width / scale / factor) * factor)
    elif new_h * new_w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * scale / factor) * factor
        new_w = math.ceil(width * scale / factor) * factor
    return new_h, new_w


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Qwen3-VL video variant: the pixel budget covers all (temporally rounded) frames."""
    if height < factor or width < factor:  # upscale tiny frames so both sides reach `factor`
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    new_h = round(height / factor) * factor
    new_w = round(width / factor) * factor
    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    if frames * new_h * new_w > max_pixels:
        scale = math.sqrt(num_frames * height * width / max_pixels)
        new_h = max(factor, math.floor(height / scale / factor) * factor)
        new_w = max(factor, math.floor(width / scale / factor) * factor)
    elif frames * new_h * new_w < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        new_h = math.ceil(height * scale / factor) * factor
        new_w = math.ceil(width * scale / factor) * factor
    return new_h, new_w


def target_size(
    height: int, width: int, cfg: VisionPreprocessConfig, num_frames: int | None = None
) -> tuple[int, int]:
    """Size a frame is resized to; with resizing off, checks the frame fits as it is.

    `num_frames` selects the whole-clip budget when `cfg.budget_over_frames` is set.
    """
    if not cfg.do_resize:
        if height * width > cfg.max_pixels:
            raise ValueError(
                f"image of {width}x{height} = {height * width} pixels exceeds max_pixels="
                f"{cfg.max_pixels}, and resizing is disabled (do_resize=False)"
            )
        if height % cfg.factor or width % cfg.factor:
            raise ValueError(
                f"image of {width}x{height} is not a multiple of {cfg.factor} (patch_size * "
                f"merge_size), and resizing is disabled (do_resize=False)"
            )
        return height, width
    if num_frames is not None and cfg.budget_over_frames:
        return smart_resize_video(
            num_frames,
            height,
            width,
            cfg.temporal_patch_size,
            cfg.factor,
            cfg.min_pixels,
            cfg.max_pixels,
        )
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)


def frame_to_array(
    image: Image.Image, size: tuple[int, int], cfg: VisionPreprocessConfig
) -> np.ndarray:
    """Resize, rescale and normalise one RGB frame -> float32 [C, H, W]."""
    height, width = size
    if image.size != (width, height):
        image = image.resize((width, height), resample=cfg.resample)
    array = np.asarray(image.convert("RGB"))
    if cfg.do_rescale:
        # float64 product then float32, the HF rescale's rounding.
        array = (array.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        array = array.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)
        std = np.asarray(cfg.image_std, dtype=np.float32)
        array = (array - mean) / std
    return np.ascontiguousarray(array.transpose(2, 0, 1))


def patchify(
    frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[T, C, H, W] frames -> ([N, C*tp*p*p] patches, (grid_t, grid_h, grid_w)).

    T is padded to a multiple of `temporal_patch_size` by repeating the last frame.
    """
    num_frames, channels, height, width = frames.shape
    if height % (patch_size * merge_size) or width % (patch_size * merge_size):
        raise ValueError(
            f"frame size {width}x{height} is not a multiple of {patch_size * merge_size}"
        )
    if pad := -num_frames % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    grid_t = frames.shape[0] // temporal_patch_size
    grid_h, grid_w = height // patch_size, width // patch_size
    m, p, tp = merge_size, patch_size, temporal_patch_size
    blocks = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    # -> (t, h-block, w-block, h-in-merge, w-in-merge, C, tp, ph, pw)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    patches = blocks.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
    return patches, (grid_t, grid_h, grid_w)


def preprocess_frames(
    frames: Sequence[Image.Image], cfg: VisionPreprocessConfig, as_video: bool = True
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames of one video (or one image) -> (float32 [N, patch_dim] pixels, (t, h, w)).

    Every frame is resized to the size computed from the first frame.
    """
    if not frames:
        raise ValueError("no frames to preprocess")
    width, height = frames[0].size
    size = target_size(height, width, cfg, num_frames=len(frames) if as_video else None)
    # Videos follow HF's video processors (torch resize), images its image processors (PIL).
    to_array = video_frame_to_array if as_video else frame_to_array
    stacked = np.stack([to_array(frame, size, cfg) for frame in frames])
    patches, grid = patchify(stacked, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return torch.from_numpy(np.ascontiguousarray(patches)), grid


def preprocess_images(
    images: Sequence[Image.Image], cfg: VisionPreprocessConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our own image path: (pixel_values [N, patch_dim], image_grid_thw int64 [n, 3]), equal
    to HF's PIL image processor's (`qwen_vl_image_pixels`: the same bits, about half the time)."""
    pixels, grids = [], []
    for image in images:
        patches, grid = image_patches(image, target_size(image.height, image.width, cfg), cfg)
        pixels.append(patches)
        grids.append(grid)
    return torch.cat(pixels), torch.tensor(grids, dtype=torch.int64)
