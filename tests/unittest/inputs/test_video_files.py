"""Video files decode with PyAV: mp4/webm written by the test, then decoded and checked."""

from __future__ import annotations

import asyncio
import base64
import io
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tensorrt_llm.inputs.utils import VideoData, is_video_like, load_video
from tensorrt_llm.inputs.utils import video_file_data as decode_video_file
from tensorrt_llm.inputs.video_files import VideoDecoderMissing

av = pytest.importorskip("av")

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]


def write_video(
    num_frames: int, fps: int, size: tuple[int, int] = (64, 48), fmt: str = "mp4"
) -> bytes:
    """A clip of solid-colour frames (COLOURS in turn) at `fps`, encoded by PyAV."""
    codec = "libx264" if fmt == "mp4" else "libvpx"
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} encoder not available")
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            pixels = np.empty((size[1], size[0], 3), np.uint8)
            pixels[...] = COLOURS[i % len(COLOURS)]
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _check_colours(video: VideoData, stride: int = 1) -> None:
    for k, frame in enumerate(video.frames):
        want = np.array(COLOURS[(k * stride) % len(COLOURS)], np.int32)
        got = np.asarray(frame, np.int32)
        assert np.abs(got - want).max() <= 8, f"frame {k}"  # yuv420p rounding only


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_decode_frames_sizes_colours_timestamps(fmt: str) -> None:
    video = decode_video_file(write_video(8, 4, fmt=fmt))
    assert len(video.frames) == 8
    assert all(frame.size == (64, 48) and frame.mode == "RGB" for frame in video.frames)
    _check_colours(video)
    assert video.timestamps is not None
    np.testing.assert_allclose(video.timestamps, [k / 4 for k in range(8)], atol=2e-3)
    assert video.fps == pytest.approx(4.0)


def test_frame_cap_samples_uniformly_by_time() -> None:
    # 10 s at 8 fps = 80 frames; a cap of 10 keeps one frame per second (every 8th frame).
    video = decode_video_file(write_video(80, 8, size=(32, 32)), max_frames=10)
    assert len(video.frames) == 10
    np.testing.assert_allclose(video.timestamps or [], [float(k) for k in range(10)], atol=1e-3)
    _check_colours(video, stride=8)
    assert video.fps == pytest.approx(1.0)


def test_pixel_bounds() -> None:
    data = write_video(8, 4, size=(64, 48))
    with pytest.raises(ValueError, match="pixel limit per frame"):
        decode_video_file(data, max_image_pixels=64 * 48 - 1)
    # The per-video pixel bound lowers the number of frames kept rather than refusing.
    fewer = decode_video_file(data, max_video_pixels=64 * 48 * 3)
    assert len(fewer.frames) <= 3


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"not a video at all", "not a video file"),
        (b"\x00\x00\x00 ftypisom" + b"\x00" * 64, "corrupt or unreadable video"),
        (b"\x1a\x45\xdf\xa3" + b"\xff" * 64, "corrupt or unreadable video|no video stream"),
    ],
)
def test_corrupt_or_non_video_is_value_error(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_video_file(data)


def test_truncated_mp4_is_value_error() -> None:
    data = write_video(8, 4)
    with pytest.raises(ValueError, match="corrupt or unreadable video|no decodable frames"):
        decode_video_file(data[: len(data) // 2])


def test_missing_pyav_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now raises ImportError
    with pytest.raises(VideoDecoderMissing, match=r"tensorrt-llm-qwenvl\[video\]"):
        decode_video_file(write_video_bytes_cached())


_CACHED: dict[str, bytes] = {}


def write_video_bytes_cached() -> bytes:
    if "clip" not in _CACHED:
        _CACHED["clip"] = write_video(4, 2, size=(56, 56))
    return _CACHED["clip"]


def test_load_video_path_bytes_and_data_url(tmp_path: Path) -> None:
    data = write_video_bytes_cached()
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    for src in (str(path), path, data, url):
        assert is_video_like(src)
        video = load_video(src, fps=9.0)  # the file's own timing wins over the fill-in
        assert len(video.frames) == 4 and video.timestamps is not None
        np.testing.assert_allclose(video.timestamps, [0.0, 0.5, 1.0, 1.5], atol=1e-3)
    with pytest.raises(ValueError, match="carries its own frame timestamps"):
        load_video(str(path), timestamps=[0, 1, 2, 3])
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00 ftypisom garbage")
    with pytest.raises(ValueError, match="corrupt or unreadable video"):
        load_video(str(bad))


def _server_video(url: str, config: Any, fps: float | None = None) -> Any:
    from tensorrt_llm.serve.media import load_video_url

    async def run() -> Any:
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(lambda r: httpx.Response(404))
        ) as c:
            return await load_video_url(url, config, c, fps=fps, param="v")

    return asyncio.run(run())


def test_server_video_url_data_and_file(tmp_path: Path) -> None:
    from tensorrt_llm.serve.media import MAX_VIDEO_FRAMES, MediaConfig, MediaError

    data = write_video_bytes_cached()
    (tmp_path / "clip.mp4").write_bytes(data)
    config = MediaConfig(allowed_local_media_path=tmp_path)
    for url in (
        "data:video/mp4;base64," + base64.b64encode(data).decode(),
        (tmp_path / "clip.mp4").as_uri(),
    ):
        video = _server_video(url, config)
        assert len(video.frames) == 4
        np.testing.assert_allclose(video.timestamps, [0.0, 0.5, 1.0, 1.5], atol=1e-3)
    with pytest.raises(MediaError) as info:
        _server_video((tmp_path / "clip.mp4").as_uri(), config, fps=2.0)
    assert info.value.code == "invalid_media_url" and info.value.param == "v"
    (tmp_path / "bad.webm").write_bytes(b"\x1a\x45\xdf\xa3 nope")
    with pytest.raises(MediaError) as info:
        _server_video((tmp_path / "bad.webm").as_uri(), config)
    assert info.value.code == "corrupt_media"
    long = write_video(MAX_VIDEO_FRAMES + 40, 30, size=(16, 16))
    capped = _server_video("data:video/mp4;base64," + base64.b64encode(long).decode(), config)
    assert len(capped.frames) <= MAX_VIDEO_FRAMES
