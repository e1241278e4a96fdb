"""Media URL resolution: data URLs, the local-path allow list, http(s) fetches with caps."""

from __future__ import annotations

import asyncio
import ipaddress
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import data_url, gif_bytes, png_bytes

from tensorrt_llm.serve import media, media_fetch
from tensorrt_llm.serve.media import (
    MediaConfig,
    MediaError,
    fetch_media_url,
    load_image_url,
    load_video_url,
)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _client(handler: Any = None) -> httpx.AsyncClient:
    transport = httpx.MockTransport(handler or (lambda request: httpx.Response(404)))
    return httpx.AsyncClient(transport=transport)


async def _image(url: str, config: MediaConfig, handler: Any = None) -> Any:
    async with _client(handler) as client:
        return await load_image_url(url, config, client, param="p")


def _error(url: str, config: MediaConfig | None = None, handler: Any = None) -> MediaError:
    with pytest.raises(MediaError) as info:
        _run(_image(url, config or MediaConfig(), handler))
    assert info.value.param == "p"
    return info.value


def test_data_url_image_roundtrip() -> None:
    image = _run(_image(data_url(png_bytes(size=(30, 20))), MediaConfig()))
    assert image.size == (30, 20) and image.mode == "RGB"
    assert image.getpixel((1, 1)) == (200, 10, 30)


@pytest.mark.parametrize(
    "url,code,fragment",
    [
        (data_url(b"\x89PNG\r\n\x1a\n broken"), "corrupt_media", "corrupt or unreadable image"),
        ("data:image/png;base64,!!!", "corrupt_media", "invalid base64"),
        ("data:image/png,raw", "invalid_media_url", "base64"),
        ("data:image/png;base64", "invalid_media_url", "malformed data URL"),
        (data_url(b"hello", "text/plain"), "unsupported_media_type", "text/plain"),
        ("gopher://x", "invalid_media_url", "'gopher'"),
        ("just words", "invalid_media_url", "unsupported source"),
        ("", "invalid_media_url", "non-empty"),
    ],
)
def test_bad_sources(url: str, code: str, fragment: str) -> None:
    err = _error(url)
    assert err.code == code and fragment in str(err)


def test_data_url_base64_decodes_with_the_media(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server only checks a data URL's header and size; its base64 is decoded with the
    image (in a preprocess worker when there is a pool), never on the event loop."""
    url = data_url(png_bytes(size=(30, 20)))
    calls: list[int] = []
    real = media.base64.b64decode

    def counted(*args: Any, **kwargs: Any) -> bytes:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(media.base64, "b64decode", counted)

    async def fetch() -> Any:
        async with _client() as client:
            return await fetch_media_url(url, "image", MediaConfig(), client, param="p")

    pending = _run(fetch())
    assert calls == []
    assert pending.decode(MediaConfig()).size == (30, 20) and calls == [1]
    # Line-wrapped base64 (MIME style) still decodes (test_bad_sources: a bad payload fails).
    head, payload = url.split(",", 1)
    wrapped = head + "," + "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))
    assert _run(_image(wrapped, MediaConfig())).size == (30, 20)


def test_data_url_size_cap() -> None:
    err = _error(data_url(png_bytes()), MediaConfig(max_media_bytes=64))
    assert err.code == "media_too_large"


def test_local_files_only_under_allowed_root(tmp_path: Path) -> None:
    root = tmp_path / "allowed"
    root.mkdir()
    (root / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    os.symlink(tmp_path / "secret.png", root / "link.png")
    config = MediaConfig(allowed_local_media_path=root)
    assert _run(_image((root / "a.png").as_uri(), config)).size == (64, 48)
    assert _run(_image(str(root / "a.png"), config)).size == (64, 48)  # a bare absolute path
    for outside in (tmp_path / "secret.png", root / "link.png", root / ".." / "secret.png"):
        err = _error(outside.as_uri() if outside.is_absolute() else str(outside), config)
        assert err.code == "local_path_not_allowed"
        assert "--allowed_local_media_path" in str(err)
    assert _error((root / "missing.png").as_uri(), config).code == "media_not_found"
    assert _error((root / "a.png").as_uri()).code == "local_media_disabled"
    small = MediaConfig(allowed_local_media_path=root, max_media_bytes=10)
    assert _error((root / "a.png").as_uri(), small).code == "media_too_large"


def test_allowed_root_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        MediaConfig(allowed_local_media_path=tmp_path / "nope")


def test_http_fetch_ok_and_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    png = png_bytes()
    seen: list[tuple[str, str]] = []

    async def public(host: str, port: int) -> list[Any]:
        return [ipaddress.ip_address("93.184.215.14")]  # a public address; nothing connects

    monkeypatch.setattr(media_fetch, "resolve_host", public)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers["host"]))
        path = request.url.path
        if path == "/ok.png":
            return httpx.Response(200, content=png, headers={"content-type": "image/png"})
        if path == "/html":
            return httpx.Response(200, content=b"<html>", headers={"content-type": "text/html"})
        if path == "/slow":
            raise httpx.ReadTimeout("slow", request=request)
        if path == "/refused":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if path == "/big":
            return httpx.Response(200, content=b"x" * 5000)
        return httpx.Response(404)

    remote = MediaConfig(allow_remote_media=True)
    assert _run(_image("http://h/ok.png", remote, handler)).size == (64, 48)
    # The connection goes to the checked address; the name travels in the Host header.
    assert seen == [("93.184.215.14", "h")]
    cases = {
        "http://h/html": ("unsupported_media_type", "text/html"),
        "http://h/slow": ("media_fetch_failed", "media fetch failed: timed out"),
        "http://h/refused": ("media_fetch_failed", "media fetch failed: connection failed"),
        "http://h/missing": ("media_fetch_failed", "media fetch failed: HTTP status 404"),
        "http://h/big": ("media_too_large", "1000-byte"),
    }
    config = MediaConfig(fetch_timeout_s=0.5, max_media_bytes=1000, allow_remote_media=True)
    for url, (code, fragment) in cases.items():
        err = _error(url, config, handler)
        assert err.code == code and fragment in str(err), (url, str(err))
        assert "Errno" not in str(err) and "refused" not in str(err)
    # Off by default: nothing is even resolved.
    err = _error("http://h/ok.png", MediaConfig(), handler)
    assert str(err).startswith("media fetch failed: remote media disabled")


def test_videos_from_animated_images_and_folders(tmp_path: Path) -> None:
    async def video(url: str, config: MediaConfig, fps: float | None = None) -> Any:
        async with _client() as client:
            return await load_video_url(url, config, client, fps=fps, param="v")

    clip = _run(
        video(data_url(gif_bytes(num_frames=3, duration_ms=250), "image/gif"), MediaConfig())
    )
    assert len(clip.frames) == 3 and clip.fps == pytest.approx(4.0)
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(png_bytes(size=(28, 28)))
    folder = _run(video(str(tmp_path), MediaConfig(allowed_local_media_path=tmp_path), fps=3.0))
    assert len(folder.frames) == 3 and folder.fps == 3.0
    with pytest.raises(MediaError) as info:
        _run(video(data_url(b"\x00\x00\x00\x18ftypmp42", "video/mp4"), MediaConfig()))
    # A video/* upload is decoded now (PyAV); this one is a truncated mp4 header.
    assert info.value.code == "corrupt_media" and "corrupt or unreadable video" in str(info.value)
    with pytest.raises(MediaError, match="corrupt or unreadable video"):
        _run(video(data_url(b"GIF89a-garbage", "image/gif"), MediaConfig()))


@pytest.mark.parametrize("decode", [True, False])
def test_detail_low_fits_the_image_into_512_square(decode: bool) -> None:
    """detail "low" (OpenAI's low-resolution pass): a 1000 x 600 image reaches the processor
    as 512 x 307, whether the server decodes it or a preprocess worker does (PendingMedia);
    "high" and small images are left as they are."""
    from tensorrt_llm.serve.chat_utils import resolve_messages
    from tensorrt_llm.serve.media import PendingMedia, decode_pending
    from tensorrt_llm.serve.openai_messages import ChatMessage

    big, small = data_url(png_bytes(size=(1000, 600))), data_url(png_bytes(size=(300, 200)))
    parts = [
        {"type": "image_url", "image_url": {"url": big, "detail": "low"}},
        {"type": "image_url", "image_url": {"url": big, "detail": "high"}},
        {"type": "image_url", "image_url": {"url": small, "detail": "low"}},
        {"type": "image_url", "image_url": big},
    ]
    message = ChatMessage.model_validate({"role": "user", "content": parts})

    async def resolve() -> Any:
        async with _client() as client:
            return await resolve_messages([message], MediaConfig(), client, decode=decode)

    resolved = _run(resolve())
    if not decode:
        assert [p["image"].max_side for p in resolved[0]["content"]] == [512, None, 512, None]
        assert all(isinstance(p["image"], PendingMedia) for p in resolved[0]["content"])
        resolved = decode_pending({"prompt": resolved}, MediaConfig())["prompt"]
    sizes = [p["image"].size for p in resolved[0]["content"]]
    assert sizes == [(512, 307), (1000, 600), (300, 200), (1000, 600)]
