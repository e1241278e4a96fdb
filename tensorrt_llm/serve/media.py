"""Resolve the media URLs of chat requests into images and videos the LLM API accepts.

Sources: `data:` URLs (base64); local files (`file://` URLs or absolute paths) only under
`--allowed_local_media_path`, read only if they are regular files (a FIFO or device is refused
without blocking) and within the byte cap; http(s) URLs only when remote media is turned on,
under the address and redirect rules of media_fetch, within one total deadline.
Images decode only as PNG, JPEG, WebP, GIF, BMP or TIFF, chosen from the magic bytes (never
from the declared MIME type), and only after the declared pixel count passed the bound.
Videos are mp4/mov or webm/mkv files (decoded with PyAV, the optional `video` extra; a server
without it answers 400 naming the extra), animated images (GIF/WebP/APNG/TIFF) or folders of
frame images, bounded in bytes, frames and pixels: container files are sampled uniformly by
time to at most MAX_VIDEO_FRAMES frames while decoding (`inputs/video_files.py`).

Every problem raises `MediaError` (a ValueError carrying the request field it came from), which
the server answers with HTTP 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import mimetypes
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import httpx
from PIL import Image

from ..inputs.image_formats import (
    ImageTooLarge,
    UnsupportedImageFormat,
    check_video_pixels,
    decode_frames,
    decode_image,
    open_image,
    video_frame_sizes,
)
from ..inputs.local_files import LocalFileError, check_path_text, read_regular_file
from ..inputs.utils import _IMAGE_SUFFIXES, VideoData, load_image, video_file_data
from ..inputs.video_files import VideoDecoderMissing, sniff_video_container
from .media_config import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_MEDIA_BYTES, MediaConfig, MediaError
from .media_fetch import fetch_remote, make_media_http_client

__all__ = [
    "DEFAULT_FETCH_TIMEOUT_S",
    "DEFAULT_MAX_MEDIA_BYTES",
    "LOW_DETAIL_MAX_SIDE",
    "MAX_VIDEO_FRAMES",
    "MediaConfig",
    "MediaError",
    "PendingMedia",
    "decode_pending",
    "fetch_media_url",
    "fit_image",
    "load_image_url",
    "load_video_url",
    "make_media_http_client",
]

# A bound on decoded video frames, so one request cannot exhaust host memory.
MAX_VIDEO_FRAMES = 256
# An image_url part with detail "low" is fitted into this square first (OpenAI's 512 x 512
# low-resolution pass), before the processor's own resizing.
LOW_DETAIL_MAX_SIDE = 512
_GENERIC_MIME = ("application/octet-stream", "binary/octet-stream", "")


@dataclass
class _Blob:
    data: bytes | None  # None for a local folder (frames of a video) or a data URL's payload
    mime: str  # "" when unknown
    where: str  # for messages
    folder: Path | None = None
    # A data URL's base64 text, decoded with the media (`content`): with a preprocess pool, in
    # its worker. Decoding ~1 MB of base64 holds the GIL for ~3 ms, which the server's event loop
    # paid per image request before.
    b64: str | None = None

    def content(self, param: str | None) -> bytes:
        """The media bytes; a data URL's payload decoded here (MediaError if it is not base64)."""
        if self.b64 is None:
            return self.data or b""
        try:
            return base64.b64decode(self.b64, validate=True)
        except (binascii.Error, ValueError):
            pass
        try:  # base64 wrapped over lines: the whitespace goes first
            return base64.b64decode("".join(self.b64.split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(f"invalid base64 in data URL: {exc}", param, "corrupt_media") from None


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:60] + "..." + url[-12:]


def _check_mime(mime: str, kind: str, where: str, param: str | None) -> None:
    """image_url needs image/*; video_url takes video/* and image/* (animated)."""
    if mime in _GENERIC_MIME or mime.startswith("image/"):
        return
    if kind == "video" and mime.startswith("video/"):
        return  # the container is judged from the magic bytes when decoding
    raise MediaError(
        f"unsupported media type {mime!r} for {kind}_url ({where})", param, "unsupported_media_type"
    )


def _parse_data_url(url: str, config: MediaConfig, param: str | None) -> _Blob:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise MediaError(
            "malformed data URL: expected data:<mime>;base64,<payload>", param, "invalid_media_url"
        )
    fields = header.split(";")
    if "base64" not in fields[1:]:
        raise MediaError(
            "data URLs must be base64 encoded (data:<mime>;base64,...)", param, "invalid_media_url"
        )
    if len(payload) * 3 // 4 > config.max_media_bytes:
        raise MediaError(
            f"data URL exceeds the {config.max_media_bytes}-byte media cap",
            param,
            "media_too_large",
        )
    return _Blob(None, fields[0].strip().lower(), "data URL", b64=payload)


def _local_path(url: str, config: MediaConfig, param: str | None) -> Path:
    root = config.allowed_local_media_path
    if root is None:
        raise MediaError(
            "local media files are disabled; start the server with --allowed_local_media_path",
            param,
            "local_media_disabled",
        )
    try:
        raw = unquote(urlparse(url).path, errors="strict") if url.startswith("file:") else url
        check_path_text(raw)
        # NOTE: resolve() follows symlinks and "..", so the containment check sees the real file.
        path = Path(raw).resolve()
    except LocalFileError as exc:
        raise MediaError(str(exc), param, "invalid_media_url") from None
    except (ValueError, UnicodeError, OSError, RuntimeError):  # bad %-escapes, symlink loops
        raise MediaError(
            f"invalid local media path {ascii(url[:64])}", param, "invalid_media_url"
        ) from None
    if not path.is_relative_to(root):
        raise MediaError(
            f"local path {raw!r} is outside the allowed media folder "
            f"(--allowed_local_media_path {root})",
            param,
            "local_path_not_allowed",
        )
    return path


_LOCAL_CODES = {
    "bad_path": "invalid_media_url",
    "not_found": "media_not_found",
    "not_regular": "invalid_media_url",
    "too_large": "media_too_large",
    "unreadable": "invalid_media_url",
}


def _read_file(path: Path, max_bytes: int, root: Path | None, param: str | None) -> bytes:
    try:
        return read_regular_file(path, max_bytes, inside=root)
    except LocalFileError as exc:
        raise MediaError(
            str(exc), param, _LOCAL_CODES.get(exc.reason, "invalid_media_url")
        ) from None


def _read_local(url: str, config: MediaConfig, kind: str, param: str | None) -> _Blob:
    path = _local_path(url, config, param)
    try:
        is_dir = path.is_dir()
    except OSError:
        is_dir = False
    if is_dir:
        if kind != "video":
            raise MediaError(
                f"local path {path} is a folder, not an image file", param, "invalid_media_url"
            )
        return _Blob(None, "", str(path), folder=path)
    data = _read_file(path, config.max_media_bytes, config.allowed_local_media_path, param)
    return _Blob(data, mimetypes.guess_type(path.name)[0] or "", str(path))


def _frame_files(folder: Path, param: str | None) -> list[Path]:
    """The frame image files of a folder, sorted by name, refusing more than MAX_VIDEO_FRAMES."""
    files: list[Path] = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if os.path.splitext(entry.name)[1].lower() not in _IMAGE_SUFFIXES:
                    continue
                files.append(Path(entry.path))
                if len(files) > MAX_VIDEO_FRAMES:
                    raise MediaError(
                        f"video folder {folder} holds more than {MAX_VIDEO_FRAMES} frames",
                        param,
                        "media_too_large",
                    )
    except OSError:
        raise MediaError(
            f"video folder {folder} cannot be listed", param, "invalid_media_url"
        ) from None
    if not files:
        raise MediaError(f"video folder {folder} holds no frame images", param, "invalid_media_url")
    return sorted(files)


def _read_frame_folder(folder: Path, config: MediaConfig, param: str | None) -> list[bytes]:
    """Each frame file's bytes; every frame is a checked regular file, all within one byte cap."""
    frames, left = [], config.max_media_bytes
    for path in _frame_files(folder, param):
        if left <= 0:
            raise MediaError(
                f"video folder {folder} is over the {config.max_media_bytes}-byte media cap",
                param,
                "media_too_large",
            )
        try:
            data = read_regular_file(path, left, inside=config.allowed_local_media_path)
        except LocalFileError as exc:
            code = _LOCAL_CODES.get(exc.reason, "invalid_media_url")
            detail = "is over the media cap in all" if exc.reason == "too_large" else str(exc)
            raise MediaError(f"video folder {folder}: {detail}", param, code) from None
        frames.append(data)
        left -= len(data)
    return frames


async def _get_blob(
    url: str, kind: str, config: MediaConfig, client: httpx.AsyncClient, param: str | None
) -> _Blob:
    if not isinstance(url, str) or not url:
        raise MediaError(f"{kind}_url.url must be a non-empty string", param, "invalid_media_url")
    if url.startswith("data:"):
        return _parse_data_url(url, config, param)
    if url.startswith(("http://", "https://")):
        data, mime = await fetch_remote(url, config, client, param)
        return _Blob(data, mime, _short(url))
    if url.startswith("file:") or os.path.isabs(url):
        return await asyncio.to_thread(_read_local, url, config, kind, param)
    scheme = url.split(":", 1)[0] if ":" in url[:16] else ""
    detail = f"URL scheme {scheme!r}" if scheme else f"source {_short(url)!r}"
    raise MediaError(
        f"unsupported {detail} for {kind}_url; use a data: URL, an http(s) URL, or a file:// "
        f"path under --allowed_local_media_path",
        param,
        "invalid_media_url",
    )


def _media_error(exc: Exception, kind: str, where: str, param: str | None) -> MediaError:
    if isinstance(exc, MediaError):
        return exc
    if isinstance(exc, VideoDecoderMissing):
        return MediaError(f"{exc} ({where})", param, "unsupported_media_type")
    if isinstance(exc, UnsupportedImageFormat):
        return MediaError(f"{exc} ({where})", param, "unsupported_media_type")
    if isinstance(exc, ImageTooLarge):
        return MediaError(f"{exc} ({where})", param, "media_too_large")
    return MediaError(f"corrupt or unreadable {kind} ({where}): {exc}", param, "corrupt_media")


def _decode_image(blob: _Blob, config: MediaConfig, param: str | None) -> Image.Image:
    data = blob.content(param)
    try:
        return load_image(decode_image(data, "", config.max_image_pixels))
    # NOTE: decoders of untrusted bytes fail in many ways (struct.error, EOFError, ...); each
    # one means the client sent a bad image, never a server fault.
    except Exception as exc:
        raise _media_error(exc, "image", blob.where, param) from None


def _decode_animation(data: bytes, config: MediaConfig) -> tuple[list[Image.Image], list[float]]:
    image = open_image(data, "", config.max_image_pixels)
    sizes = video_frame_sizes(image, data, MAX_VIDEO_FRAMES + 1)
    if len(sizes) > MAX_VIDEO_FRAMES:
        raise ImageTooLarge(f"video has more than {MAX_VIDEO_FRAMES} frames")
    check_video_pixels(sizes, "", config.max_video_pixels, config.max_image_pixels)
    return decode_frames(image, sizes, "", load_image)


def _decode_folder(blob: _Blob, config: MediaConfig, param: str | None) -> list[Image.Image]:
    assert blob.folder is not None
    files = _read_frame_folder(blob.folder, config, param)
    opened = [
        open_image(data, f"frame {i}", config.max_image_pixels) for i, data in enumerate(files)
    ]
    sizes = [image.size for image in opened]
    check_video_pixels(sizes, "", config.max_video_pixels, config.max_image_pixels)
    frames: list[Image.Image] = []
    for image, size in zip(opened, sizes, strict=True):
        frames.extend(decode_frames(image, [size], "", load_image)[0])
    return frames


def _decode_video(
    blob: _Blob, fps: float | None, config: MediaConfig, param: str | None
) -> VideoData:
    data = blob.content(param)
    try:
        if blob.folder is not None:
            return VideoData(frames=_decode_folder(blob, config, param), fps=fps)
        if blob.mime.startswith("video/") or sniff_video_container(data):
            return _decode_container(data, fps, config, param)
        frames, durations = _decode_animation(data, config)
    except Exception as exc:  # see _decode_image
        raise _media_error(exc, "video", blob.where, param) from None
    if fps is None and durations and all(d > 0 for d in durations):
        fps = 1000.0 * len(durations) / sum(durations)  # the animation's own frame rate
    return VideoData(frames=frames, fps=fps)


def _decode_container(
    data: bytes, fps: float | None, config: MediaConfig, param: str | None
) -> VideoData:
    if fps is not None:
        # NOTE: refused, not ignored: a video file carries its own frame times.
        raise MediaError(
            "video_url.fps is for animated images and frame folders; a video file carries its "
            "own frame timing",
            param,
            "invalid_media_url",
        )
    return video_file_data(
        data,
        max_frames=MAX_VIDEO_FRAMES,
        max_image_pixels=config.max_image_pixels,
        max_video_pixels=config.max_video_pixels,
    )


@dataclass(frozen=True)
class PendingMedia:
    """A fetched image or video whose bytes are not decoded yet.

    The server fetches (async I/O, with the address guard) and hands these on; with a preprocess
    pool they are decoded in its worker processes, so the server process never runs the
    decoders. Picklable: bytes (or a data URL's base64 text) and settings only.
    """

    kind: str  # "image" or "video"
    blob: _Blob
    param: str | None
    fps: float | None = None
    # An image fitted into max_side x max_side after decoding (detail "low"); None: as is.
    max_side: int | None = None

    def decode(self, config: MediaConfig) -> Image.Image | VideoData:
        """The RGB image, or the video's frames + fps. Raises MediaError."""
        if self.kind == "image":
            image = _decode_image(self.blob, config, self.param)
            return fit_image(image, self.max_side) if self.max_side else image
        return _decode_video(self.blob, self.fps, config, self.param)


def fit_image(image: Image.Image, max_side: int) -> Image.Image:
    """`image` scaled down (aspect kept, bicubic) so neither side exceeds `max_side`."""
    if max(image.size) <= max_side:
        return image
    scale = max_side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


async def fetch_media_url(
    url: str,
    kind: str,
    config: MediaConfig,
    client: httpx.AsyncClient,
    fps: float | None = None,
    param: str | None = None,
) -> PendingMedia:
    """Read a data:/file:/http(s) URL (or a local frame folder) without decoding it."""
    blob = await _get_blob(url, kind, config, client, param)
    if blob.folder is None:
        _check_mime(blob.mime, kind, blob.where, param)
    return PendingMedia(kind, blob, param, fps)


async def load_image_url(
    url: str,
    config: MediaConfig,
    client: httpx.AsyncClient,
    param: str | None = None,
    max_side: int | None = None,
) -> Image.Image:
    """An RGB image from a data:/file:/http(s) URL (fitted into `max_side` when given).
    Raises MediaError."""
    pending = await fetch_media_url(url, "image", config, client, param=param)
    pending = replace(pending, max_side=max_side)
    return await asyncio.to_thread(pending.decode, config)  # type: ignore[return-value]


async def load_video_url(
    url: str,
    config: MediaConfig,
    client: httpx.AsyncClient,
    fps: float | None = None,
    param: str | None = None,
) -> VideoData:
    """A video (RGB frames + fps) from a data:/file:/http(s) URL or a local frame folder."""
    pending = await fetch_media_url(url, "video", config, client, fps=fps, param=param)
    return await asyncio.to_thread(pending.decode, config)  # type: ignore[return-value]


def decode_pending(prompt: Any, config: MediaConfig) -> Any:
    """`prompt` ({"prompt": chat messages} or anything else) with every PendingMedia of its
    messages decoded; other prompts are returned as they are."""
    messages = prompt.get("prompt") if isinstance(prompt, dict) else None
    if not isinstance(messages, list):
        return prompt
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            message = {**message, "content": [_decoded_part(p, config) for p in content]}
        out.append(message)
    return {**prompt, "prompt": out}


def _decoded_part(part: Any, config: MediaConfig) -> Any:
    if isinstance(part, dict):
        value = part.get(part.get("type", ""))
        if isinstance(value, PendingMedia):
            return {**part, value.kind: value.decode(config)}
    return part
