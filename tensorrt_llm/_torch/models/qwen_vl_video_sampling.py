"""Which frames of a video the Qwen-VL processors encode, and when each one was shown.

Kept apart from the pixel path of `qwen_vl_media`: choosing frames and their timestamps only
reads the video's frame count, fps and timestamps, never the pixels, and each model family
brings its own sampling rule (`sample_indices_qwen2` / `sample_indices_qwen3`, matching HF).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class VideoSampling:
    """Frame sampling of a video processor: keep `target_fps` frames per second of video."""

    do_sample_frames: bool = False
    target_fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any], **defaults: Any) -> VideoSampling:
        base = cls(**defaults)
        return replace(
            base,
            do_sample_frames=bool(cfg.get("do_sample_frames", base.do_sample_frames)),
            target_fps=float(cfg.get("fps") or base.target_fps),
            min_frames=int(cfg.get("min_frames", base.min_frames)),
            max_frames=int(cfg.get("max_frames", base.max_frames)),
        )


def sample_indices_qwen3(
    total: int, source_fps: float, sampling: VideoSampling, num_frames: int | None = None
) -> np.ndarray:
    """Qwen3-VL rule: evenly spaced (rounded) indices, `target_fps` per second, clamped."""
    if num_frames is None:
        num_frames = int(total / source_fps * sampling.target_fps)
        num_frames = min(max(num_frames, sampling.min_frames), sampling.max_frames, total)
    num_frames = max(1, min(int(num_frames), total))
    return np.linspace(0, total - 1, num_frames).round().astype(np.int64)


def sample_indices_qwen2(
    total: int,
    source_fps: float,
    sampling: VideoSampling,
    temporal_patch_size: int,
    num_frames: int | None = None,
) -> np.ndarray:
    """Qwen2-VL rule: a multiple of `temporal_patch_size` frames at a fixed stride."""
    if num_frames is None:
        cap = math.floor(min(sampling.max_frames, total) / temporal_patch_size)
        target = total / source_fps * sampling.target_fps
        target = min(max(target, sampling.min_frames), cap * temporal_patch_size, total)
        num_frames = math.floor(target / temporal_patch_size) * temporal_patch_size
    else:
        num_frames = round(num_frames / temporal_patch_size) * temporal_patch_size
    if not 0 < num_frames <= total:
        raise ValueError(
            f"cannot sample {num_frames} frames from a video of {total} frames "
            f"(temporal_patch_size={temporal_patch_size})"
        )
    return np.arange(0, total, total / num_frames).astype(np.int64)[:num_frames]


def group_timestamps(seconds: Sequence[float], temporal_patch_size: int) -> list[float]:
    """One timestamp per temporal patch: the mean of its first and last frame's time.

    The frame list is padded by repeating the last time, as the frames themselves are.
    """
    times = [float(s) for s in seconds]
    if not times:
        return []
    times += [times[-1]] * (-len(times) % temporal_patch_size)
    step = temporal_patch_size
    return [(times[i] + times[i + step - 1]) / 2 for i in range(0, len(times), step)]


def _fps_of_times(seconds: Sequence[float]) -> float | None:
    span = float(seconds[-1]) - float(seconds[0]) if len(seconds) > 1 else 0.0
    return (len(seconds) - 1) / span if span > 0 else None


def select_video_frames(
    index: int,
    video: Any,
    kwargs: dict[str, Any],
    *,
    owner: str,
    needs_timing: bool,
    sampling: VideoSampling,
    sample_indices: Callable[[int, float, int | None], np.ndarray],
) -> tuple[list[Image.Image], list[float] | None, float | None]:
    """Frames to encode, their times in seconds, and their rate (each None if unknown).

    `kwargs` are the request's mm_processor_kwargs (fps, num_frames, do_sample_frames);
    `sample_indices(total, fps, num_frames)` is the family's frame-sampling rule.
    """
    fps = float(kwargs["fps"]) if kwargs.get("fps") is not None else video.fps
    total = len(video.frames)
    seconds = video.timestamps
    if seconds is None and fps is not None:
        seconds = [k / fps for k in range(total)]
    if seconds is None and needs_timing:
        raise ValueError(
            f"video {index} has no timing: {owner} needs the frames' fps or "
            f"timestamps (VideoData(fps=...), or mm_processor_kwargs={{'fps': ...}})"
        )
    rate = fps if video.timestamps is None else _fps_of_times(video.timestamps)
    indices = list(range(total))
    num_frames = kwargs.get("num_frames")
    if kwargs.get("do_sample_frames", sampling.do_sample_frames) or num_frames is not None:
        if rate is None and num_frames is None:
            raise ValueError(
                f"video {index}: sampling frames by fps needs the video's fps or timestamps"
            )
        indices = sample_indices(total, rate or 1.0, num_frames).tolist()
        rate = None if rate is None else len(indices) / total * rate
    frames = [video.frames[k] for k in indices]
    times = None if seconds is None else [float(seconds[k]) for k in indices]
    return frames, times, rate
