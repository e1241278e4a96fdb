"""Open untrusted image bytes safely: an allowlist of formats, and pixel bounds before decoding.

PIL picks a decoder by probing every registered plugin, and some plugins hand the bytes to
outside programs (EPS runs Ghostscript) or to large, rarely used parsers. So the format is
chosen here from the leading magic bytes, never from a declared MIME type or file name, and
`Image.open(..., formats=[that one])` makes PIL try only that plugin.

A small compressed file can declare a huge canvas (a 17 KB 1-bit PNG of 12000x12000 decodes to
~430 MB of RGB), so the declared size (width x height, times frames for a video) is checked
against a bound after the header is parsed and before any pixel data is decoded.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable

from PIL import Image, UnidentifiedImageError

# 32 Mpx per image, 256 Mpx per video: far above what any Qwen-VL processor keeps (it resizes
# to at most a few Mpx), yet small enough that decoding one item cannot exhaust host memory.
DEFAULT_MAX_IMAGE_PIXELS = 32_000_000
DEFAULT_MAX_VIDEO_PIXELS = 256_000_000
SUPPORTED_IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# Formats that can hold more than one frame (animated images used as videos).
_MULTI_FRAME = ("PNG", "WEBP", "GIF", "TIFF")


class UnsupportedImageFormat(ValueError):
    """The bytes are not one of SUPPORTED_IMAGE_FORMATS (judged from the magic bytes)."""


class ImageTooLarge(ValueError):
    """The declared pixel count is over the bound; nothing was decoded."""


def sniff_image_format(data: bytes) -> str | None:
    """The PIL format name of `data` from its magic bytes, or None if it is not supported."""
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head.startswith(b"BM"):
        return "BMP"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "TIFF"
    return None


def _named(what: str) -> str:
    return f" {what}" if what else ""


def _format_error(what: str) -> UnsupportedImageFormat:
    names = ", ".join(SUPPORTED_IMAGE_FORMATS)
    return UnsupportedImageFormat(
        f"unsupported image format{f' ({what})' if what else ''}: the bytes are not one of {names}"
    )


def open_image(data: bytes, what: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """A lazily opened image: header parsed, format allowlisted, no pixel data decoded yet.

    Raises UnsupportedImageFormat, ImageTooLarge, or ValueError("corrupt image ...").
    """
    fmt = sniff_image_format(data)
    if fmt is None:
        raise _format_error(what)
    try:
        image = Image.open(io.BytesIO(data), formats=[fmt])
    # NOTE: PIL's own bomb guard fires inside open() for canvases over twice its limit (and
    # warns, which a warnings filter may turn into a raise, above it): both mean "too large".
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image{_named(what)} is too large: {exc}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error) as exc:
        raise ValueError(f"corrupt image{_named(what)}: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"image{_named(what)} declares {width}x{height} = {width * height} pixels, over the "
            f"{max_pixels}-pixel limit"
        )
    return image


def decode_image(data: bytes, what: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """open_image, then decode the (first frame's) pixels now, so truncated data fails here."""
    image = open_image(data, what, max_pixels)
    _load(image, what)
    return image


def _load(image: Image.Image, what: str) -> None:
    try:
        image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image{_named(what)} is too large: {exc}") from None
    # NOTE: decoders of untrusted bytes fail in many ways (struct.error, EOFError, ...); each
    # one means the caller sent a bad image.
    except Exception as exc:
        raise ValueError(f"corrupt image{_named(what)}: {exc}") from None


def _gif_frame_sizes(data: bytes, limit: int) -> list[tuple[int, int]]:
    """(width, height) of each GIF frame as PIL will decode it, for at most `limit` frames.

    PIL's n_frames walks the whole file with no bound (about 3 us per frame, so a 32 MB file of
    1x1 frames takes seconds), and seeking frame by frame decodes each one; this walks the
    block structure only and stops after `limit` frames.
    """
    if len(data) < 13:
        return []
    canvas_w, canvas_h, flags = struct.unpack_from("<HHB", data, 6)
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    sizes: list[tuple[int, int]] = []
    while pos < len(data) and len(sizes) < limit:
        block = data[pos]
        if block == 0x3B:  # trailer
            break
        if block == 0x21:  # extension: label, then data sub-blocks
            pos = _skip_sub_blocks(data, pos + 2)
        elif block == 0x2C:  # image descriptor
            if pos + 10 > len(data):
                break
            x, y, w, h, local = struct.unpack_from("<HHHHB", data, pos + 1)
            # PIL grows the canvas to hold a frame that sticks out of it.
            canvas_w, canvas_h = max(canvas_w, x + w), max(canvas_h, y + h)
            sizes.append((canvas_w, canvas_h))
            pos += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0)
            pos = _skip_sub_blocks(data, pos + 1)  # after the LZW minimum code size
        else:
            break  # PIL stops at an unknown block too
    return sizes


def _skip_sub_blocks(data: bytes, pos: int) -> int:
    while pos < len(data):
        size = data[pos]
        pos += 1 + size
        if size == 0:
            break
    return pos


def _seek_frame_sizes(image: Image.Image, limit: int) -> list[tuple[int, int]]:
    """Frame sizes by seeking (TIFF pages: header parsing only; pixels load on demand)."""
    sizes = []
    for index in range(limit):
        try:
            image.seek(index)
        except EOFError:
            break
        sizes.append(image.size)
    image.seek(0)
    return sizes


def video_frame_sizes(image: Image.Image, data: bytes, limit: int) -> list[tuple[int, int]]:
    """Declared (width, height) of the first `limit` frames of an opened image, undecoded."""
    fmt = image.format or ""
    if fmt == "GIF":
        return _gif_frame_sizes(data, limit) or [image.size]
    if fmt == "TIFF":
        return _seek_frame_sizes(image, limit)
    if fmt in _MULTI_FRAME:  # APNG and WebP declare the frame count in a header chunk
        return [image.size] * min(getattr(image, "n_frames", 1), limit)
    return [image.size]


def check_video_pixels(
    sizes: list[tuple[int, int]], what: str, max_video_pixels: int, max_image_pixels: int
) -> None:
    """Refuse a video whose declared frames add up to more than the pixel bounds."""
    for width, height in sizes:
        if width * height > max_image_pixels:
            raise ImageTooLarge(
                f"video{_named(what)} has a {width}x{height} frame, over the "
                f"{max_image_pixels}-pixel limit per frame"
            )
    total = sum(w * h for w, h in sizes)
    if total > max_video_pixels:
        raise ImageTooLarge(
            f"video{_named(what)} declares {len(sizes)} frames of {total} pixels in all, over the "
            f"{max_video_pixels}-pixel limit"
        )


def decode_frames(
    image: Image.Image,
    sizes: list[tuple[int, int]],
    what: str,
    convert: Callable[[Image.Image], Image.Image],
) -> tuple[list[Image.Image], list[float]]:
    """Decode the frames whose declared `sizes` passed the bounds, through `convert`.

    Returns the frames and their durations in ms (0 where the file gives none).
    """
    frames, durations = [], []
    for index, (width, height) in enumerate(sizes):
        try:
            image.seek(index)
        except EOFError:
            break
        # NOTE: the bound was checked on `sizes`; a frame PIL sees as larger than declared
        # (a malformed file) is refused rather than decoded.
        if image.size[0] * image.size[1] > width * height:
            raise ImageTooLarge(f"video{_named(what)} frame {index} is larger than its header says")
        _load(image, what)
        frames.append(convert(image.copy()))
        durations.append(float(image.info.get("duration") or 0))
    return frames, durations
