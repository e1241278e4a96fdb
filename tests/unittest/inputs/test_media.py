"""Media loading (tensorrt_llm.inputs.utils) and Qwen-VL pixel preprocessing (qwen_vl_media).

Pixel parity is checked against the HF Qwen2-VL image processor, and the video pieces against
the HF Qwen3-VL video processor's torch-only helpers (smart_resize, patchify, sample_frames).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as hf_smart_resize_video,
)
from transformers.video_utils import VideoMetadata

from tensorrt_llm._torch.models.qwen_vl_media import (
    VideoSampling,
    VisionPreprocessConfig,
    group_timestamps,
    patchify,
    preprocess_frames,
    preprocess_images,
    sample_indices_qwen3,
    smart_resize,
    smart_resize_video,
    target_size,
)
from tensorrt_llm.inputs.utils import (
    VideoData,
    collect_multimodal_data,
    load_image,
    load_video,
    media_from_messages,
)


def _rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


# ------------------------------------------------------------------------------ load_image


def test_load_image_all_forms_give_the_same_pixels(tmp_path: Path) -> None:
    array = _rgb(12, 17)
    png = _png_bytes(array)
    path = tmp_path / "x.png"
    path.write_bytes(png)
    b64 = base64.b64encode(png).decode()
    forms = [
        Image.fromarray(array),
        torch.from_numpy(array).permute(2, 0, 1),  # [C,H,W] uint8
        torch.from_numpy(array),  # [H,W,C] uint8
        array,
        array.transpose(2, 0, 1),
        str(path),
        path,
        f"data:image/png;base64,{b64}",
        b64,
        png,
        bytearray(png),
    ]
    for form in forms:
        image = load_image(form)
        assert image.mode == "RGB" and image.size == (17, 12), type(form)
        np.testing.assert_array_equal(np.asarray(image), array)


def test_load_image_float_grayscale_and_alpha() -> None:
    array = _rgb(6, 5)
    as_float = torch.from_numpy(array).permute(2, 0, 1).float() / 255
    np.testing.assert_array_equal(np.asarray(load_image(as_float)), array)
    gray = array[..., 0]
    out = np.asarray(load_image(gray))
    assert out.shape == (6, 5, 3) and (out == gray[..., None]).all()
    rgba = np.concatenate([array, np.zeros((6, 5, 1), np.uint8)], axis=-1)  # fully transparent
    assert (np.asarray(load_image(Image.fromarray(rgba, "RGBA"))) == 255).all()


@pytest.mark.parametrize(
    "bad, match",
    [
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "corrupt image"),
        (b"definitely not an image", r"unsupported image format \(bytes\)"),
        (_png_bytes(_rgb(20, 20))[:60], "corrupt image"),  # truncated
        ("data:image/png;base64," + base64.b64encode(b"junk").decode(), "unsupported image"),
        ("no/such/file.png", "not an existing file"),
        ("data:image/png,rawtext", "base64"),
        (np.zeros((5, 6, 7), np.uint8), r"\[C,H,W\] or \[H,W,C\]"),
        (np.full((4, 4, 3), 2.0, np.float32), r"\[0, 1\]"),
        (3.5, "unsupported image type"),
    ],
)
def test_load_image_bad_input(bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_image(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ load_video


def test_load_video_forms(tmp_path: Path) -> None:
    frames = [_rgb(8, 9, seed=i) for i in range(3)]
    for i, frame in enumerate(frames):
        (tmp_path / f"f{i:02d}.png").write_bytes(_png_bytes(frame))
    stacked = np.stack(frames)
    forms = [
        frames,
        [Image.fromarray(frames[0]), torch.from_numpy(frames[1]).permute(2, 0, 1), frames[2]],
        stacked,
        torch.from_numpy(stacked).permute(0, 3, 1, 2),
        tmp_path,
    ]
    for form in forms:
        video = load_video(form, fps=4.0)
        assert video.fps == 4.0 and video.timestamps is None
        for got, want in zip(video.frames, frames, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
    kept = load_video(VideoData([Image.fromarray(f) for f in frames], fps=2.0), fps=9.0)
    assert kept.fps == 2.0  # the video's own fps wins over the fill-in
    timed = load_video(frames, timestamps=[0, 0.5, 1.0])
    assert timed.timestamps == [0.0, 0.5, 1.0] and timed.fps is None


def test_load_video_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot decode video"):
        load_video(str(tmp_path / "clip.mp4"))
    with pytest.raises(ValueError, match="3 frames but 2 timestamps"):
        load_video([_rgb(4, 4)] * 3, timestamps=[0.0, 1.0])
    with pytest.raises(ValueError, match="fps must be positive"):
        load_video([_rgb(4, 4)], fps=0.0)
    with pytest.raises(ValueError, match="at least one frame"):
        load_video([])
    with pytest.raises(ValueError, match="unsupported image format"):
        load_video([b"garbage"])


def test_collect_multimodal_data() -> None:
    image = Image.new("RGB", (4, 4))
    video = VideoData([image], fps=1.0)
    data = collect_multimodal_data({"image": image, "video": video})
    assert data == {"image": [image], "video": [video]}
    frames = [image, image]
    assert collect_multimodal_data({"video": frames})["video"] == [frames]  # one video
    assert collect_multimodal_data({"video": [frames, frames]})["video"] == [frames, frames]
    assert len(collect_multimodal_data({"image": np.zeros((3, 4, 4, 3), np.uint8)})["image"]) == 3
    with pytest.raises(ValueError, match=r"unknown modality key\(s\) \['audio'\]"):
        collect_multimodal_data({"audio": [1]})


def test_media_from_messages() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "a"},
                {"type": "image_url", "image_url": {"url": "b"}},
                {"type": "image"},
                {"type": "video", "video": "v"},
                {"type": "text", "text": "hi"},
            ],
        },
    ]
    assert media_from_messages(messages) == {"image": ["a", "b"], "video": ["v"]}
    with pytest.raises(ValueError, match="unknown chat content part type 'audio'"):
        media_from_messages([{"role": "user", "content": [{"type": "audio"}]}])


# ------------------------------------------------------------------------ qwen_vl_media


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3000),
    st.integers(1, 3000),
    st.sampled_from([28, 32]),
    st.integers(1, 64),
    st.integers(1, 64),
)
def test_smart_resize_matches_hf(h: int, w: int, factor: int, lo: int, span: int) -> None:
    min_px, max_px = lo * factor * factor, (lo + span) * factor * factor
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(h, w, factor, min_px, max_px)
        return
    assert smart_resize(h, w, factor, min_px, max_px) == hf_smart_resize(
        h, w, factor, min_px, max_px
    )


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 40), st.integers(8, 900), st.integers(8, 900), st.integers(1, 64))
def test_smart_resize_video_matches_hf(t: int, h: int, w: int, budget: int) -> None:
    args = dict(temporal_factor=2, factor=32, min_pixels=4 * 32 * 32, max_pixels=budget * 4096)
    try:
        want = hf_smart_resize_video(t, h, w, **args)
    except ValueError:
        with pytest.raises(ValueError):
            smart_resize_video(t, h, w, 2, 32, args["min_pixels"], args["max_pixels"])
        return
    assert smart_resize_video(t, h, w, 2, 32, args["min_pixels"], args["max_pixels"]) == want


_QWEN3_STYLE = dict(
    patch_size=16,
    image_mean=[0.5] * 3,
    image_std=[0.5] * 3,
    min_pixels=32 * 32 * 4,
    max_pixels=32 * 32 * 64,
)


@pytest.mark.parametrize(
    "kwargs",
    [{}, _QWEN3_STYLE, {"do_normalize": False}, {"do_rescale": False}, {"rescale_factor": 0.5}],
    ids=["qwen2", "qwen3", "no-normalize", "no-rescale", "rescale-0.5"],
)
def test_preprocess_images_matches_hf_image_processor(kwargs: dict) -> None:
    hf = Qwen2VLImageProcessorPil(**kwargs)
    cfg = VisionPreprocessConfig.from_mapping(hf)
    images = [Image.fromarray(_rgb(h, w, seed=h)) for h, w in [(77, 123), (300, 41), (8, 9)]]
    want = hf(images=images, return_tensors="pt")
    pixels, grids = preprocess_images(images, cfg)
    assert torch.equal(grids, want["image_grid_thw"])
    assert torch.equal(pixels, want["pixel_values"])  # bit-exact, not just close


def test_video_of_repeated_frames_equals_the_image() -> None:
    """A static clip of temporal_patch_size frames has exactly the image's patches."""
    cfg = VisionPreprocessConfig.from_mapping(_QWEN3_STYLE)
    frame = Image.fromarray(_rgb(70, 100))
    image_pixels, image_grid = preprocess_images([frame], cfg)
    video_pixels, video_grid = preprocess_frames([frame, frame], cfg, as_video=False)
    assert video_grid == tuple(image_grid[0].tolist())
    assert torch.equal(video_pixels, image_pixels)


def test_patchify_matches_hf_video_patch_order() -> None:
    frames = torch.randn(5, 3, 64, 96)  # odd T: the last frame repeats into the final group
    want, *want_grid = Qwen3VLVideoProcessor.patchify(
        None, frames[None], patch_size=16, merge_size=2, temporal_patch_size=2
    )
    got, grid = patchify(frames.numpy(), 16, 2, 2)
    assert grid == tuple(want_grid) == (3, 4, 6)
    assert torch.equal(torch.from_numpy(got), want[0])


def test_video_grid_and_padding() -> None:
    cfg = VisionPreprocessConfig.from_mapping(_QWEN3_STYLE, budget_over_frames=True)
    frames = [Image.fromarray(_rgb(64, 64, seed=i)) for i in range(3)]
    pixels, grid = preprocess_frames(frames, cfg)
    assert grid == (2, 4, 4) and pixels.shape == (2 * 4 * 4, 3 * 2 * 16 * 16)
    padded, _ = preprocess_frames(frames + [frames[-1]], cfg)
    assert torch.equal(pixels, padded)  # 3 frames pad by repeating the last one


def test_target_size_without_resize() -> None:
    cfg = VisionPreprocessConfig(max_pixels=56 * 56, do_resize=False)
    assert target_size(56, 28, cfg) == (56, 28)
    with pytest.raises(ValueError, match=r"84x84 = 7056 pixels exceeds max_pixels=3136"):
        target_size(84, 84, cfg)
    with pytest.raises(ValueError, match="not a multiple of 28"):
        target_size(30, 28, cfg)


@pytest.mark.parametrize("total, fps", [(5, 2.0), (40, 30.0), (300, 24.0), (7, 1.0), (3, 2.0)])
def test_sample_indices_qwen3_matches_hf(total: int, fps: float) -> None:
    sampling = VideoSampling(do_sample_frames=True, target_fps=2.0, min_frames=4, max_frames=20)
    fake = SimpleNamespace(fps=2.0, min_frames=4, max_frames=20)
    want = Qwen3VLVideoProcessor.sample_frames(fake, VideoMetadata(total_num_frames=total, fps=fps))
    np.testing.assert_array_equal(sample_indices_qwen3(total, fps, sampling), want)


@pytest.mark.parametrize("indices", [[0, 1, 2, 3, 4], [0, 3, 7, 11], [2], [0, 10, 20, 30, 40, 50]])
def test_group_timestamps_match_hf(indices: list[int]) -> None:
    fps = 3.0
    want = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
    assert group_timestamps([i / fps for i in indices], 2) == pytest.approx(want, abs=0)
