"""Media loading: every accepted image or video form becomes RGB PIL frames.

Images: PIL images, torch tensors or numpy arrays ([C,H,W], [H,W,C] or [H,W]; uint8, or float
in [0, 1]), file paths, `data:` URLs, raw base64 strings, bytes, and http(s) URLs.
Videos: a `VideoData`, a sequence of frames in any image form, a 4-D array/tensor
([T,C,H,W] or [T,H,W,C]), a folder of frame images (sorted by name), or an mp4/mov/webm/mkv
file given as a path, bytes, a `data:video/...;base64,` URL or an http(s) URL, decoded with
PyAV (the optional `video` extra; see `video_files.py` for the frame and pixel bounds).
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .image_formats import DEFAULT_MAX_IMAGE_PIXELS, decode_image
from .local_files import read_regular_file
from .video_files import VIDEO_FILE_SUFFIXES, decode_video_file, sniff_video_container

ImageSource = Image.Image | torch.Tensor | np.ndarray | str | os.PathLike | bytes | bytearray

_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")
_URL_TIMEOUT_S = 30.0


@dataclass
class VideoData:
    """Decoded video frames plus the timing the Qwen-VL models need.

    fps: the rate the given frames were sampled at (frames per second of `frames`).
    timestamps: optional seconds of each frame; wins over `fps` where both are given.
    """

    frames: list[Image.Image]
    fps: float | None = None
    timestamps: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.frames:
            raise ValueError("a video needs at least one frame")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"video fps must be positive, got {self.fps}")
        if self.timestamps is not None and len(self.timestamps) != len(self.frames):
            raise ValueError(
                f"video has {len(self.frames)} frames but {len(self.timestamps)} timestamps"
            )


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy; transparency is composited onto white (as the HF image processors do)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


# A cap on one image file or download of the Python API: generous (the caller is trusted),
# but a FIFO, /dev/zero or an endless response cannot hang or exhaust the process.
_MAX_IMAGE_FILE_BYTES = 256 * 1024 * 1024


def _open_bytes(data: bytes, what: str) -> Image.Image:
    # NOTE: the format comes from the magic bytes (an allowlist, so PIL never hands them to
    # Ghostscript & co.) and the declared size is bounded before decoding; the pixels are
    # decoded now, so truncated data fails here and not deep in a resize.
    return decode_image(data, what, DEFAULT_MAX_IMAGE_PIXELS)


def _read_image_file(path: Path) -> Image.Image:
    return _open_bytes(read_regular_file(path, _MAX_IMAGE_FILE_BYTES), f"file {path}")


def _array_to_image(array: np.ndarray, prefer_channels_first: bool) -> Image.Image:
    if array.ndim == 3:
        first, last = array.shape[0] in (1, 3, 4), array.shape[-1] in (1, 3, 4)
        if first and (prefer_channels_first or not last):
            array = np.moveaxis(array, 0, -1)
        elif not last:
            raise ValueError(f"image array must be [C,H,W] or [H,W,C], got {list(array.shape)}")
        if array.shape[-1] == 1:
            array = array[..., 0]
    elif array.ndim != 2:
        raise ValueError(f"image array must have 2 or 3 dims, got {list(array.shape)}")
    # NOTE: only real numbers are pixels. A complex array would be cast to its real part,
    # a bool one read as 0/1 levels, and NaN compares False with every bound, so a NaN-filled
    # array would pass the range check below and turn into an arbitrary image.
    kind = array.dtype.kind
    if kind not in "uif":
        raise ValueError(
            f"image array dtype {array.dtype} is not supported: give uint8 values in [0, 255] "
            f"or float values in [0, 1]"
        )
    if kind == "f":
        if array.size and not np.isfinite(array).all():
            raise ValueError("image array holds NaN or infinite values")
        if array.size and (array.min() < 0.0 or array.max() > 1.0):
            raise ValueError("float image values must lie in [0, 1]")
        array = np.rint(array * 255.0)
    elif array.dtype != np.uint8:
        if array.size and (array.min() < 0 or array.max() > 255):
            raise ValueError("integer image values must lie in [0, 255]")
    return _to_rgb(Image.fromarray(np.ascontiguousarray(array.astype(np.uint8))))


def _tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16; half-precision pixels are widened (exact) before the checks.
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.detach().cpu().resolve_conj().resolve_neg().numpy()


def _load_image_string(src: str) -> Image.Image:
    if src.startswith("data:"):
        header, _, payload = src.partition(",")
        if ";base64" not in header:
            raise ValueError("image data URL must be base64 encoded (data:<mime>;base64,...)")
        return _open_bytes(_b64decode(payload, "data URL"), "in data URL")
    if src.startswith(("http://", "https://")):
        with urllib.request.urlopen(src, timeout=_URL_TIMEOUT_S) as response:
            data = response.read(_MAX_IMAGE_FILE_BYTES + 1)
        if len(data) > _MAX_IMAGE_FILE_BYTES:
            raise ValueError(f"image at {src[:64]} is over {_MAX_IMAGE_FILE_BYTES} bytes")
        return _open_bytes(data, f"at {src[:64]}")
    if len(src) < 4096 and os.path.isfile(src):
        return _read_image_file(Path(src))
    try:
        data = _b64decode(src, "string")
    except ValueError:
        raise ValueError(
            f"image string is not an existing file, a data URL, an http(s) URL or base64: "
            f"{src[:64]!r}"
        ) from None
    return _open_bytes(data, "in base64 string")


def _b64decode(payload: str, what: str, kind: str = "image") -> bytes:
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"invalid base64 in {kind} {what}: {exc}") from exc


def load_image(src: ImageSource) -> Image.Image:
    """Load any accepted image form as an RGB PIL image. Bad input raises ValueError."""
    if isinstance(src, Image.Image):
        return _to_rgb(src)
    if isinstance(src, torch.Tensor):
        return _array_to_image(_tensor_to_numpy(src), prefer_channels_first=True)
    if isinstance(src, np.ndarray):
        return _array_to_image(src, prefer_channels_first=False)
    if isinstance(src, bytes | bytearray):
        return _to_rgb(_open_bytes(bytes(src), "bytes"))
    if isinstance(src, os.PathLike):
        path = Path(src)
        if not path.is_file():
            raise ValueError(f"image file not found: {ascii(str(path)[:256])}")
        return _to_rgb(_read_image_file(path))
    if isinstance(src, str):
        return _to_rgb(_load_image_string(src))
    raise ValueError(f"unsupported image type {type(src).__name__}")


def _video_file_bytes(src: Any) -> bytes | None:
    """The bytes of a video file source (path, bytes, data:/http(s) URL), else None."""
    if isinstance(src, bytes | bytearray):
        return bytes(src) if sniff_video_container(bytes(src)) else None
    if isinstance(src, str) and src.startswith("data:video/"):
        header, _, payload = src.partition(",")
        if ";base64" not in header:
            raise ValueError("video data URL must be base64 encoded (data:<mime>;base64,...)")
        return _b64decode(payload, "data URL", "video")
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        with urllib.request.urlopen(src, timeout=_URL_TIMEOUT_S) as response:
            data = response.read(_MAX_IMAGE_FILE_BYTES + 1)
        if len(data) > _MAX_IMAGE_FILE_BYTES:
            raise ValueError(f"video at {src[:64]} is over {_MAX_IMAGE_FILE_BYTES} bytes")
        return data
    if isinstance(src, str | os.PathLike) and len(str(src)) < 4096 and Path(src).is_file():
        return read_regular_file(Path(src), _MAX_IMAGE_FILE_BYTES)
    return None


def _video_frames(src: Any) -> list[Image.Image]:
    if isinstance(src, torch.Tensor | np.ndarray):
        if src.ndim != 4:
            raise ValueError(
                f"video array must be [T,C,H,W] or [T,H,W,C], got {list(src.shape)} (one "
                f"frame is an image: pass it under 'image', or as a list of frames)"
            )
        return [load_image(frame) for frame in src]
    if isinstance(src, str | os.PathLike) and Path(src).is_dir():
        files = sorted(p for p in Path(src).iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"video folder {src} holds no frame images")
        return [load_image(p) for p in files]
    if isinstance(src, str | os.PathLike):
        raise ValueError(
            f"cannot decode video {str(src)[:64]!r}: it is not an existing video file, a folder "
            f"of frame images, a data:video URL or an http(s) URL"
        )
    if isinstance(src, bytes | bytearray):
        raise ValueError("video bytes are not an mp4/mov or webm/mkv file")
    if isinstance(src, Sequence):
        return [load_image(frame) for frame in src]
    raise ValueError(f"unsupported video type {type(src).__name__}")


def load_video(
    src: VideoData | Sequence[ImageSource] | torch.Tensor | np.ndarray | str | os.PathLike,
    fps: float | None = None,
    timestamps: Sequence[float] | None = None,
) -> VideoData:
    """Load a video as RGB frames. `fps`/`timestamps` fill in timing the source lacks."""
    if isinstance(src, VideoData):
        return VideoData(
            frames=[_to_rgb(frame) for frame in src.frames],
            fps=src.fps if src.fps is not None else fps,
            timestamps=src.timestamps if src.timestamps is not None else _floats(timestamps),
        )
    data = _video_file_bytes(src)
    if data is not None:
        if timestamps is not None:
            raise ValueError("a video file carries its own frame timestamps; do not pass any")
        # The file's own timing is used; `fps` only fills in timing a source lacks.
        return video_file_data(data, "file" if isinstance(src, str | os.PathLike) else "")
    return VideoData(frames=_video_frames(src), fps=fps, timestamps=_floats(timestamps))


def video_file_data(data: bytes, what: str = "", **bounds: int) -> VideoData:
    """An mp4/mov/webm/mkv file's bytes decoded with PyAV (bounds: see `decode_video_file`)."""
    frames, fps, timestamps = decode_video_file(data, what, **bounds)
    return VideoData(frames=frames, fps=fps, timestamps=timestamps)


def _floats(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


def is_video_like(src: Any) -> bool:
    """True for forms that are one whole video (not a single frame)."""
    if isinstance(src, VideoData):
        return True
    if isinstance(src, torch.Tensor | np.ndarray):
        return src.ndim == 4
    if isinstance(src, bytes | bytearray):
        return sniff_video_container(bytes(src)) is not None
    if isinstance(src, str) and src.startswith("data:video/"):
        return True
    if isinstance(src, str | os.PathLike):
        if len(str(src)) >= 4096:
            return False
        path = Path(src)
        return path.is_dir() or (path.suffix.lower() in VIDEO_FILE_SUFFIXES and path.is_file())
    return isinstance(src, Sequence) and not isinstance(src, str | bytes | bytearray)


# ---------------------------------------------------------------- multimodal data of a prompt

MODALITIES: tuple[str, ...] = ("image", "video")


def _as_item_list(modality: str, value: Any) -> list[Any]:
    """One item or a list of items -> a list. A video may itself be a list of frames."""
    if value is None:
        return []
    if modality == "image":
        if isinstance(value, list | tuple):
            return list(value)
        if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 4:
            return list(value)  # a batch of images
        return [value]
    # video: a single video is a VideoData, a 4-D array, a folder, or a flat list of frames.
    if isinstance(value, list | tuple) and value and all(is_video_like(v) for v in value):
        return list(value)
    return [value]


def collect_multimodal_data(
    multi_modal_data: dict[str, Any] | None,
) -> dict[str, list[Any]]:
    """Validate the modality keys and turn each value into a list of items (not loaded yet)."""
    data = multi_modal_data or {}
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict, got {type(data).__name__}")
    unknown = sorted(set(data) - set(MODALITIES))
    if unknown:
        raise ValueError(
            f"unknown modality key(s) {unknown} in multi_modal_data; supported: {list(MODALITIES)}"
        )
    return {m: _as_item_list(m, data.get(m)) for m in MODALITIES}


def media_from_messages(messages: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Media carried inside chat content parts, in prompt order.

    A part {"type": "image", "image": src} (or "image_url": src | {"url": src}) carries an
    image; {"type": "video", "video": src} a video. Parts without a source are placeholders
    for `multi_modal_data` items.
    """
    found: dict[str, list[Any]] = {m: [] for m in MODALITIES}
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError("every chat message must be a dict with a 'role' and a 'content'")
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "image_url"):
                src = part.get("image", part.get("image_url"))
                if isinstance(src, dict):
                    src = src.get("url")
                if src is not None:
                    found["image"].append(src)
            elif kind == "video":
                src = part.get("video", part.get("video_url"))
                if src is not None:
                    found["video"].append(src)
            elif kind != "text":
                raise ValueError(f"unknown chat content part type {kind!r}")
    return found
