"""Untrusted image bytes: the format allowlist (magic bytes) and pixel bounds before decoding.

Covers the Python API (tensorrt_llm.inputs.utils.load_image) and the server's media layer
(tensorrt_llm.serve.media), which share tensorrt_llm.inputs.image_formats.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import time
import warnings
import zlib
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import EpsImagePlugin, Image

from tensorrt_llm.inputs.image_formats import (
    _gif_frame_sizes,
    sniff_image_format,
)
from tensorrt_llm.inputs.utils import load_image
from tensorrt_llm.serve.media import MediaConfig, MediaError, load_image_url, load_video_url


def _saved(image: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _serve(url: str, config: MediaConfig | None = None, video: bool = False) -> Any:
    async def run() -> Any:
        async with httpx.AsyncClient() as client:
            if video:
                return await load_video_url(url, config or MediaConfig(), client, param="p")
            return await load_image_url(url, config or MediaConfig(), client, param="p")

    return asyncio.run(run())


def _serve_error(url: str, config: MediaConfig | None = None, video: bool = False) -> MediaError:
    with pytest.raises(MediaError) as info:
        _serve(url, config, video)
    assert info.value.param == "p"
    return info.value


EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
    b"newpath 0 0 moveto 8 8 lineto stroke showpage\n%%EOF\n"
)


@pytest.mark.parametrize(
    "fmt, kwargs",
    [("PNG", {}), ("JPEG", {}), ("WEBP", {}), ("GIF", {}), ("BMP", {}), ("TIFF", {})],
)
def test_allowed_formats_are_sniffed_and_decoded(fmt: str, kwargs: dict) -> None:
    data = _saved(Image.new("RGB", (9, 7), (10, 200, 30)), fmt, **kwargs)
    assert sniff_image_format(data) == fmt
    assert load_image(data).size == (9, 7)
    assert _serve(_data_url(data, "application/octet-stream")).size == (9, 7)


def _never(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("PIL handed the bytes to a plugin outside the allowlist")


@pytest.mark.parametrize(
    "payload",
    [
        EPS,
        _saved(Image.new("RGB", (4, 4)), "PPM"),
        _saved(Image.new("RGB", (16, 16)), "ICO"),
        _saved(Image.new("RGB", (4, 4)), "PCX"),
        b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj<<>>endobj\n",
    ],
    ids=["eps", "ppm", "ico", "pcx", "pdf"],
)
def test_other_formats_never_reach_pil_plugins(
    monkeypatch: pytest.MonkeyPatch, payload: bytes
) -> None:
    """A data:image/png URL holding EPS (or PPM, ICO, ...) is refused before any plugin runs."""
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", _never)
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", _never)
    assert sniff_image_format(payload) is None
    err = _serve_error(_data_url(payload, "image/png"))
    assert err.code == "unsupported_media_type" and "unsupported image format" in str(err)
    with pytest.raises(ValueError, match="unsupported image format"):
        load_image(payload)
    with pytest.raises(ValueError, match="unsupported image format"):
        load_image(base64.b64encode(payload).decode())


def _png_bomb(width: int, height: int) -> bytes:
    """A valid 1-bit all-black PNG of width x height, a few KB per 10 Mpx."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    packer = zlib.compressobj(9)
    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_pixel_bomb_png_is_refused_before_decoding() -> None:
    bomb = _png_bomb(12000, 12000)
    assert len(bomb) < 64_000  # ~17 KB on disk, 144 Mpx declared
    start = time.monotonic()
    err = _serve_error(_data_url(bomb))
    with pytest.raises(ValueError, match="12000x12000"):
        load_image(bomb)
    elapsed = time.monotonic() - start
    assert err.code == "media_too_large" and "12000x12000" in str(err)
    assert elapsed < 0.5, elapsed  # decoding it would take seconds and GBs
    small = MediaConfig(max_image_pixels=99)
    assert _serve_error(_data_url(_png_bomb(10, 10)), small).code == "media_too_large"
    assert _serve(_data_url(_png_bomb(9, 11)), small).size == (9, 11)


def test_pil_bomb_guard_is_a_clear_error_not_a_crash() -> None:
    """PIL's own guard (an error above 2x its limit, a warning above it that a filter may
    raise) must surface as "too large", never as an unexpected exception."""
    huge = _png_bomb(20000, 20000)  # 400 Mpx: over twice PIL's MAX_IMAGE_PIXELS
    with pytest.raises(ValueError, match="too large"):
        load_image(huge)
    assert _serve_error(_data_url(huge)).code == "media_too_large"
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(ValueError, match="too large"):
            load_image(_png_bomb(12000, 12000))


def _gif_of_frames(width: int, height: int, count: int) -> bytes:
    """An animated GIF of `count` copies of one width x height frame, encoded once."""
    one = _saved(Image.new("P", (width, height), 0), "GIF")
    frame_start = 13 + (3 << ((one[10] & 7) + 1) if one[10] & 0x80 else 0)
    assert one[frame_start] == 0x2C and one[-1] == 0x3B
    head, body = b"GIF89a" + one[6:frame_start], one[frame_start:-1]  # drop the trailer
    loop = b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"
    delay = b"\x21\xf9\x04\x00\x0a\x00\x00\x00"  # 100 ms per frame
    return head + loop + (delay + body) * count + b"\x3b"


def test_gif_video_of_many_large_frames_is_refused_before_decoding() -> None:
    gif = _gif_of_frames(2000, 2000, 100)  # 400 Mpx in all
    assert Image.open(io.BytesIO(gif)).n_frames == 100  # what PIL would decode
    start = time.monotonic()
    err = _serve_error(_data_url(gif, "image/gif"), video=True)
    assert time.monotonic() - start < 1.0
    assert err.code == "media_too_large" and "100 frames" in str(err)
    ok = _serve(_data_url(_gif_of_frames(20, 10, 3), "image/gif"), video=True)
    assert len(ok.frames) == 3 and ok.fps == pytest.approx(10.0)


def test_video_frame_count_is_capped_before_decoding() -> None:
    err = _serve_error(_data_url(_gif_of_frames(2, 2, 300), "image/gif"), video=True)
    assert err.code == "media_too_large" and "more than 256 frames" in str(err)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(0, 255)),
        min_size=1,
        max_size=6,
    )
)
def test_gif_frame_walker_agrees_with_pil(frames: list[tuple[int, int, int]]) -> None:
    images = [Image.new("P", (w, h), color) for w, h, color in frames]
    data = _saved(images[0], "GIF", save_all=True, append_images=images[1:], duration=50)
    image = Image.open(io.BytesIO(data))
    want = []
    for index in range(image.n_frames):
        image.seek(index)
        want.append(image.size)
    assert _gif_frame_sizes(data, 1000) == want
    assert _gif_frame_sizes(data, 2) == want[:2]
