"""Decode video files (mp4/mov, webm/mkv) with PyAV into `VideoData` (RGB frames + seconds).

PyAV (`av` on PyPI) is optional: install the `video` extra
(`pip install 'tensorrt-llm-qwenvl[video]'`). Without it, decoding a video file raises
`VideoDecoderMissing`, a ValueError naming that extra.

Bounds, all enforced while decoding (a 30-minute clip is never turned into RGB as a whole):
- The container is chosen from the magic bytes (ISO-BMFF or Matroska/WebM) and FFmpeg is told
  that demuxer, so it never probes other formats on untrusted bytes.
- Each frame must be within `max_image_pixels`, as images are (`image_formats.py`).
- At most `max_frames` frames are kept (768 by default, the Qwen-VL processors' `max_frames`),
  and fewer where the frames would pass `max_video_pixels` in all. When the stream announces
  more frames than that, frames are kept uniformly by timestamp over the clip's duration; when
  the duration is unknown (or the announced count was too low), decoding stops at the cap.
  Frames not kept are decoded (codecs need their references) but never converted to RGB.
- Timestamps are the frames' presentation times in seconds, counted from the first frame, so
  `select_video_frames`'s `fps`/`num_frames` sampling and Qwen3-VL's timestamps apply as given.
A corrupt or non-video file raises ValueError.
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from .image_formats import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_VIDEO_PIXELS, ImageTooLarge

# The Qwen-VL video processors' default `max_frames`: more frames would be sampled away anyway.
DEFAULT_MAX_DECODED_FRAMES = 768
VIDEO_EXTRA_HINT = "pip install 'tensorrt-llm-qwenvl[video]'"
VIDEO_FILE_SUFFIXES = (".mp4", ".m4v", ".mov", ".webm", ".mkv")
# ISO-BMFF box types a file may open with (QuickTime files often start with wide/mdat/free).
_BMFF_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")
_FFMPEG_DEMUXER = {"MP4": "mp4", "WEBM": "webm"}


class VideoDecoderMissing(ValueError):
    """PyAV is not installed, so video files cannot be decoded."""


def sniff_video_container(data: bytes) -> str | None:
    """ "MP4" (mp4/mov/m4v) or "WEBM" (webm/mkv) from the magic bytes, else None."""
    if len(data) >= 8 and data[4:8] in _BMFF_BOXES:
        return "MP4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "WEBM"
    return None


def is_video_mime(mime: str) -> bool:
    return mime.startswith("video/")


def _import_av() -> Any:
    try:
        import av
    except ImportError:
        raise VideoDecoderMissing(
            f"decoding video files (mp4/webm/mov) needs PyAV, which is not installed: "
            f"{VIDEO_EXTRA_HINT} (or pip install av), or pass decoded frames instead"
        ) from None
    return av


def _named(what: str) -> str:
    return f" ({what})" if what else ""


def _duration_s(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
        if seconds > 0:
            return seconds
    if container.duration:  # in AV_TIME_BASE units (microseconds)
        return float(container.duration) / 1_000_000
    return None


def _frame_budget(width: int, height: int, max_frames: int, max_video_pixels: int) -> int:
    """How many frames may be kept: the frame cap, lowered so the pixels stay in bound."""
    per_frame = max(width * height, 1)
    return max(1, min(max_frames, max_video_pixels // per_frame))


class _Picker:
    """Chooses which decoded frames to keep, uniformly by time when there are too many."""

    def __init__(self, budget: int, expected: int | None, duration: float | None) -> None:
        self.budget = budget
        # Uniform targets only when the stream says there are more frames than the budget.
        self.step = duration / budget if (expected or 0) > budget and duration else None
        self.next_target = 0.0

    def keep(self, seconds: float) -> bool:
        if self.step is None:
            return True
        if seconds + 1e-6 < self.next_target:
            return False
        # NOTE: advance past this frame's time, so a long gap never makes the next frames
        # all "late" and kept one after another.
        while self.next_target <= seconds + 1e-6:
            self.next_target += self.step
        return True

    def full(self, kept: int) -> bool:
        return kept >= self.budget


def decode_video_file(
    data: bytes,
    what: str = "",
    max_frames: int = DEFAULT_MAX_DECODED_FRAMES,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS,
) -> tuple[list[Image.Image], float | None, list[float]]:
    """The bytes of an mp4/mov/webm/mkv file as (RGB frames, fps, timestamps in seconds).

    `utils.load_video` wraps them in a `VideoData` (kept there, so this module imports no
    other of the package's loaders).

    Raises VideoDecoderMissing without PyAV, ImageTooLarge over a pixel bound, and ValueError
    for anything that is not a decodable video.
    """
    container_kind = sniff_video_container(data)
    if container_kind is None:
        raise ValueError(f"not a video file{_named(what)}: the bytes are not mp4/mov or webm/mkv")
    if max_frames < 1:
        raise ValueError(f"max_frames must be at least 1, got {max_frames}")
    av = _import_av()
    try:
        container = av.open(io.BytesIO(data), mode="r", format=_FFMPEG_DEMUXER[container_kind])
    except Exception as exc:  # FFmpeg errors of every kind mean the bytes are bad
        raise ValueError(f"corrupt or unreadable video{_named(what)}: {exc}") from None
    try:
        frames, times, rate = _decode_stream(
            container, what, max_frames, max_image_pixels, max_video_pixels
        )
    finally:
        container.close()
    if not frames:
        raise ValueError(f"video{_named(what)} holds no decodable frames")
    return frames, rate, times


def _decode_stream(
    container: Any, what: str, max_frames: int, max_image_pixels: int, max_video_pixels: int
) -> tuple[list[Any], list[float], float | None]:
    if not container.streams.video:
        raise ValueError(f"file{_named(what)} has no video stream")
    stream = container.streams.video[0]
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    if width * height > max_image_pixels:
        raise ImageTooLarge(
            f"video{_named(what)} has {width}x{height} frames, over the {max_image_pixels}-pixel "
            f"limit per frame"
        )
    stream.thread_type = "AUTO"
    duration = _duration_s(container, stream)
    source_fps = float(stream.average_rate) if stream.average_rate else None
    expected = int(stream.frames) if stream.frames else None
    if expected is None and duration and source_fps:
        expected = round(duration * source_fps)
    picker = _Picker(_frame_budget(width, height, max_frames, max_video_pixels), expected, duration)
    frames: list[Any] = []
    times: list[float] = []
    start: float | None = None
    pixels = 0
    try:
        for index, frame in enumerate(container.decode(stream)):
            if frame.width * frame.height > max_image_pixels:  # the size may change mid-stream
                raise ImageTooLarge(
                    f"video{_named(what)} frame {index} is {frame.width}x{frame.height}, over "
                    f"the {max_image_pixels}-pixel limit per frame"
                )
            seconds = _frame_seconds(frame, index, source_fps)
            start = seconds if start is None else start
            seconds -= start
            if times and seconds <= times[-1]:
                continue  # a repeated or out-of-order time would break the frame timing
            if not picker.keep(seconds):
                continue
            pixels += frame.width * frame.height
            if pixels > max_video_pixels:
                raise ImageTooLarge(
                    f"video{_named(what)} frames pass the {max_video_pixels}-pixel limit in all"
                )
            frames.append(frame.to_image().convert("RGB"))
            times.append(seconds)
            if picker.full(len(frames)):
                break
    except ImageTooLarge:
        raise
    except Exception as exc:  # PyAV's errors (some of them ValueErrors) get one clear message
        raise ValueError(f"corrupt or unreadable video{_named(what)}: {exc}") from None
    all_kept = picker.step is None and not picker.full(len(frames))
    rate = source_fps if all_kept else _rate_of(times)
    return frames, times, rate


def _frame_seconds(frame: Any, index: int, source_fps: float | None) -> float:
    if frame.time is not None:
        return float(frame.time)
    if source_fps:
        return index / source_fps
    raise ValueError("video frames carry no timestamps and the stream gives no frame rate")


def _rate_of(times: list[float]) -> float | None:
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return (len(times) - 1) / span if span > 0 else None
