"""Local media files and bad paths or URLs: refused at once with a MediaError (HTTP 400)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import png_bytes

from tensorrt_llm.serve import media
from tensorrt_llm.serve.media import MediaConfig, MediaError, load_image_url, load_video_url


def _load(url: str, config: MediaConfig, video: bool = False) -> Any:
    async def run() -> Any:
        async with httpx.AsyncClient() as client:
            if video:
                return await load_video_url(url, config, client, fps=2.0, param="p")
            return await load_image_url(url, config, client, param="p")

    return asyncio.run(run())


def _error_soon(url: str, config: MediaConfig, video: bool = False) -> MediaError:
    """The MediaError of loading `url`, which must come within seconds (never a hang)."""
    outcome: list[BaseException | None] = []

    def work() -> None:
        try:
            _load(url, config, video)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 (handed to the test thread)
            outcome.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), f"loading {url!r} blocked"
    assert outcome and isinstance(outcome[0], MediaError), outcome
    assert outcome[0].param == "p"
    return outcome[0]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "allowed"
    folder.mkdir()
    (folder / "a.png").write_bytes(png_bytes(size=(8, 6)))
    return folder


def _unblock(fifo: Path) -> None:
    """Open the FIFO for writing once, so a reader that did block (old code) is released."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass  # no reader: nothing was blocked


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_at_once(root: Path) -> None:
    fifo = root / "pipe.png"
    os.mkfifo(fifo)
    before = threading.active_count()
    try:
        err = _error_soon(fifo.as_uri(), MediaConfig(allowed_local_media_path=root))
        assert "not a regular file" in str(err) and err.code == "invalid_media_url"
        clip = root / "clip"
        clip.mkdir()
        (clip / "0.png").write_bytes(png_bytes(size=(8, 6)))
        os.mkfifo(clip / "1.png")
        err = _error_soon(str(clip), MediaConfig(allowed_local_media_path=root), video=True)
        assert "not a regular file" in str(err)
    finally:
        _unblock(fifo)
        _unblock(root / "clip" / "1.png")
    assert threading.active_count() <= before  # no worker thread is left blocked on it


def test_devices_and_folders_are_not_images(root: Path) -> None:
    (root / "dir.png").mkdir()
    config = MediaConfig(allowed_local_media_path=root)
    assert "folder" in str(_error_soon((root / "dir.png").as_uri(), config))
    os.symlink("/dev/zero", root / "zero.png")  # resolves outside the folder
    assert _error_soon((root / "zero.png").as_uri(), config).code == "local_path_not_allowed"


def test_frame_folder_caps(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = root / "clip"
    clip.mkdir()
    frame = png_bytes(size=(8, 6))
    for i in range(3):
        (clip / f"{i}.png").write_bytes(frame)
    config = MediaConfig(allowed_local_media_path=root)
    video = _load(str(clip), config, video=True)
    assert len(video.frames) == 3 and video.fps == 2.0
    # The byte cap holds for the folder in all, not per frame.
    small = MediaConfig(allowed_local_media_path=root, max_media_bytes=2 * len(frame) + 10)
    err = _error_soon(str(clip), small, video=True)
    assert err.code == "media_too_large"
    # The frame count is capped from the listing, before any frame is read.
    monkeypatch.setattr(media, "MAX_VIDEO_FRAMES", 2)
    err = _error_soon(str(clip), config, video=True)
    assert err.code == "media_too_large" and "more than 2 frames" in str(err)
    monkeypatch.undo()
    # And so are the pixels of all frames together.
    few = MediaConfig(allowed_local_media_path=root, max_video_pixels=2 * 8 * 6)
    assert _error_soon(str(clip), few, video=True).code == "media_too_large"


def test_file_byte_cap_holds(root: Path) -> None:
    config = MediaConfig(allowed_local_media_path=root, max_media_bytes=10)
    assert _error_soon((root / "a.png").as_uri(), config).code == "media_too_large"


@pytest.mark.parametrize(
    "make_url, fragment",
    [
        (lambda r: (r / "a.png").as_uri().replace("a.png", "a%00.png"), "NUL byte"),
        (lambda r: str(r / "a\x00.png"), "NUL byte"),
        (lambda r: str(r / "\ud800.png"), "lone surrogate"),
        (lambda r: (r / "x").as_uri() + "%ED%A0%80.png", "invalid local media path"),
        (lambda r: str(r / ("d/" * 2100)), "over the 4096 limit"),
        (lambda r: str(r / ("n" * 300 + ".png")), "name over 255 bytes"),
        (lambda r: (r / "a.png").as_uri().replace("/allowed/", "/allowed/%2e%2e/"), "outside"),
    ],
    ids=["nul-file-url", "nul-path", "surrogate", "encoded-surrogate", "long", "long-name", "dots"],
)
def test_bad_local_paths_are_400s(root: Path, make_url: Any, fragment: str) -> None:
    err = _error_soon(make_url(root), MediaConfig(allowed_local_media_path=root))
    assert fragment in str(err), str(err)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999/a.png",
        "http://[::1/a.png",
        "https://exa mple.com/a.png",
        "http://\ud800.test/a.png",
        "http://" + "a" * 70 + ".test/a.png",  # a DNS label over 63 characters
    ],
)
def test_bad_urls_are_400s(url: str) -> None:
    for config in (MediaConfig(), MediaConfig(allow_remote_media=True)):
        err = _error_soon(url, config)
        assert str(err).startswith("media fetch failed"), str(err)
