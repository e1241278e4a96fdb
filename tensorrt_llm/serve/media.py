"""Resolve the media URLs of chat requests into images and videos the LLM API accepts.

Sources: `data:` URLs (base64), local files (`file://` URLs or absolute paths) only under
`--allowed_local_media_path`, and http(s) URLs fetched with a timeout and a size cap.
Videos are animated images (GIF/WebP/APNG/TIFF) or folders of frame images: no video decoder
is bundled, so video container formats are rejected with a message saying what to send.

Every problem raises `MediaError` (a ValueError carrying the request field it came from), which
the server answers with HTTP 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import mimetypes
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
from PIL import Image, ImageSequence

from ..inputs.utils import VideoData, load_image, load_video

DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_MEDIA_BYTES = 32 * 1024 * 1024
# A bound on decoded video frames, so one request cannot exhaust host memory.
MAX_VIDEO_FRAMES = 256
_GENERIC_MIME = ("application/octet-stream", "binary/octet-stream", "")


class MediaError(ValueError):
    """A media source that cannot be used.

    param: the request field it came from; code: a stable machine-readable reason
    (invalid_media_url, unsupported_media_type, corrupt_media, media_too_large,
    media_fetch_failed, local_media_disabled, local_path_not_allowed, media_not_found).
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_media") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class MediaConfig:
    """Where media may come from. allowed_local_media_path=None disables local files."""

    allowed_local_media_path: Path | None = None
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES

    def __post_init__(self) -> None:
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path).expanduser().resolve()
            if not root.is_dir():
                raise ValueError(f"--allowed_local_media_path {root} is not a directory")
            object.__setattr__(self, "allowed_local_media_path", root)
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")
        if self.max_media_bytes < 1:
            raise ValueError(f"max_media_bytes must be >= 1, got {self.max_media_bytes}")


@dataclass
class _Blob:
    data: bytes | None  # None for a local folder (frames of a video)
    mime: str  # "" when unknown
    where: str  # for messages
    folder: Path | None = None


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:60] + "..." + url[-12:]


def _check_mime(mime: str, kind: str, where: str, param: str | None) -> None:
    """image_url needs image/*; video_url takes image/* (animated) and rejects video/*."""
    if mime in _GENERIC_MIME or mime.startswith("image/"):
        return
    if kind == "video" and mime.startswith("video/"):
        raise MediaError(
            f"unsupported media type {mime!r} for video_url ({where}): this server has no video "
            f"decoder; send an animated image (GIF/WebP/APNG) or a folder of frames",
            param,
            "unsupported_media_type",
        )
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
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"invalid base64 in data URL: {exc}", param, "corrupt_media") from None
    return _Blob(data, fields[0].strip().lower(), "data URL")


def _local_path(url: str, config: MediaConfig, param: str | None) -> Path:
    raw = unquote(urlparse(url).path) if url.startswith("file:") else url
    root = config.allowed_local_media_path
    if root is None:
        raise MediaError(
            "local media files are disabled; start the server with --allowed_local_media_path",
            param,
            "local_media_disabled",
        )
    # NOTE: resolve() follows symlinks and "..", so the containment check sees the real file.
    path = Path(raw).resolve()
    if not path.is_relative_to(root):
        raise MediaError(
            f"local path {raw!r} is outside the allowed media folder "
            f"(--allowed_local_media_path {root})",
            param,
            "local_path_not_allowed",
        )
    if not path.exists():
        raise MediaError(f"local media file {raw!r} does not exist", param, "media_not_found")
    return path


def _read_local(url: str, config: MediaConfig, kind: str, param: str | None) -> _Blob:
    path = _local_path(url, config, param)
    if path.is_dir():
        if kind != "video":
            raise MediaError(
                f"local path {path} is a folder, not an image file", param, "invalid_media_url"
            )
        return _Blob(None, "", str(path), folder=path)
    size = path.stat().st_size
    if size > config.max_media_bytes:
        raise MediaError(
            f"local file {path} has {size} bytes, over the {config.max_media_bytes}-byte cap",
            param,
            "media_too_large",
        )
    mime = mimetypes.guess_type(path.name)[0] or ""
    return _Blob(path.read_bytes(), mime, str(path))


async def _fetch(
    url: str, config: MediaConfig, client: httpx.AsyncClient, param: str | None
) -> _Blob:
    where = _short(url)
    try:
        async with client.stream("GET", url, timeout=config.fetch_timeout_s) as response:
            if response.status_code != 200:
                raise MediaError(
                    f"fetching {where} failed: HTTP {response.status_code}",
                    param,
                    "media_fetch_failed",
                )
            declared = response.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > config.max_media_bytes:
                raise MediaError(
                    f"{where} is {declared} bytes, over the {config.max_media_bytes}-byte cap",
                    param,
                    "media_too_large",
                )
            chunks, total = [], 0
            async for chunk in response.aiter_bytes():
                total += len(chunk)
                if total > config.max_media_bytes:
                    raise MediaError(
                        f"{where} is over the {config.max_media_bytes}-byte media cap",
                        param,
                        "media_too_large",
                    )
                chunks.append(chunk)
            mime = response.headers.get("content-type", "").split(";")[0].strip().lower()
    except httpx.TimeoutException:
        raise MediaError(
            f"fetching {where} timed out after {config.fetch_timeout_s} s",
            param,
            "media_fetch_failed",
        ) from None
    except MediaError:
        raise
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:  # ValueError: bad URL text
        raise MediaError(
            f"fetching {where} failed: {type(exc).__name__}: {exc}", param, "media_fetch_failed"
        ) from None
    return _Blob(b"".join(chunks), mime, where)


async def _get_blob(
    url: str, kind: str, config: MediaConfig, client: httpx.AsyncClient, param: str | None
) -> _Blob:
    if not isinstance(url, str) or not url:
        raise MediaError(f"{kind}_url.url must be a non-empty string", param, "invalid_media_url")
    if url.startswith("data:"):
        return _parse_data_url(url, config, param)
    if url.startswith(("http://", "https://")):
        return await _fetch(url, config, client, param)
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


def _decode_image(blob: _Blob, param: str | None) -> Image.Image:
    try:
        return load_image(blob.data or b"")
    # NOTE: decoders of untrusted bytes fail in many ways (struct.error, EOFError, bomb
    # guards, ...); each one means the client sent a bad image, never a server fault.
    except Exception as exc:
        raise MediaError(
            f"corrupt or unreadable image ({blob.where}): {exc}", param, "corrupt_media"
        ) from None


def _decode_video(blob: _Blob, fps: float | None, param: str | None) -> VideoData:
    try:
        if blob.folder is not None:
            video = load_video(blob.folder, fps=fps)
            if len(video.frames) > MAX_VIDEO_FRAMES:
                raise ValueError(f"more than {MAX_VIDEO_FRAMES} frames")
            return video
        image = Image.open(io.BytesIO(blob.data or b""))
        frames, durations = [], []
        for frame in ImageSequence.Iterator(image):
            if len(frames) >= MAX_VIDEO_FRAMES:
                raise ValueError(f"more than {MAX_VIDEO_FRAMES} frames")
            frames.append(load_image(frame.copy()))
            durations.append(frame.info.get("duration") or 0)
    except Exception as exc:  # see _decode_image
        raise MediaError(
            f"corrupt or unreadable video ({blob.where}): {exc}", param, "corrupt_media"
        ) from None
    if fps is None and all(d > 0 for d in durations):
        fps = 1000.0 * len(durations) / sum(durations)  # the animation's own frame rate
    return VideoData(frames=frames, fps=fps)


async def load_image_url(
    url: str, config: MediaConfig, client: httpx.AsyncClient, param: str | None = None
) -> Image.Image:
    """An RGB image from a data:/file:/http(s) URL. Raises MediaError."""
    blob = await _get_blob(url, "image", config, client, param)
    if blob.folder is None:
        _check_mime(blob.mime, "image", blob.where, param)
    return await asyncio.to_thread(_decode_image, blob, param)


async def load_video_url(
    url: str,
    config: MediaConfig,
    client: httpx.AsyncClient,
    fps: float | None = None,
    param: str | None = None,
) -> VideoData:
    """A video (RGB frames + fps) from a data:/file:/http(s) URL or a local frame folder."""
    blob = await _get_blob(url, "video", config, client, param)
    if blob.folder is None:
        _check_mime(blob.mime, "video", blob.where, param)
    return await asyncio.to_thread(_decode_video, blob, fps, param)
