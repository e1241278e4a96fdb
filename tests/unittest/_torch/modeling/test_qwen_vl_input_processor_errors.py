"""Qwen-VL input processors: bad input gets a ValueError naming the problem; probe sizing.

Fixtures `ckpts` and `procs` come from this folder's conftest.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from processor_test_helpers import FAMILIES, TIMED
from processor_test_helpers import frames as _frames
from processor_test_helpers import image as _image

from tensorrt_llm.inputs.registry import (
    create_input_processor,
)
from tensorrt_llm.inputs.utils import VideoData


@pytest.mark.parametrize("family", FAMILIES)
def test_placeholder_count_mismatch(family: str, procs: dict[str, Any]) -> None:
    proc = procs[family]
    one_image = proc.default_multimodal_prompt("q", num_images=1)
    two_images = proc.default_multimodal_prompt("q", num_images=2)
    video = VideoData(_frames(2), fps=2.0)
    cases = [
        (two_images, {"image": [_image(40, 40)]}, "2 image placeholder\\(s\\).* but 1 image"),
        (one_image, {"image": [_image(40, 40)] * 2}, "1 image placeholder\\(s\\).* but 2 image"),
        (one_image, {}, "1 image placeholder\\(s\\).* but 0 image"),
        (
            one_image + "<|vision_start|><|video_pad|><|vision_end|>",
            {"image": [_image(40, 40)]},
            "1 video placeholder\\(s\\).* but 0 video",
        ),
        (
            one_image,
            {"image": [_image(40, 40)], "video": [video]},
            "0 video placeholder\\(s\\).* but 1 video",
        ),
    ]
    for prompt, data, match in cases:
        with pytest.raises(ValueError, match=f"placeholder count mismatch: .*{match}"):
            proc({"prompt": prompt, "multi_modal_data": data})


def test_bad_media_and_kwargs(procs: dict[str, Any]) -> None:
    proc = procs["qwen2_vl"]
    prompt = proc.default_multimodal_prompt("q")
    with pytest.raises(ValueError, match="image 0: corrupt image bytes"):
        proc({"prompt": prompt, "multi_modal_data": {"image": b"\x89PNG\r\n\x1a\nbroken"}})
    with pytest.raises(ValueError, match=r"unknown modality key\(s\) \['audio'\]"):
        proc({"prompt": prompt, "multi_modal_data": {"audio": [b"x"]}})
    with pytest.raises(ValueError, match=r"unknown mm_processor_kwargs \['max_pixel'\]"):
        proc({"prompt": "hi", "mm_processor_kwargs": {"max_pixel": 10}})


@pytest.mark.parametrize("family", FAMILIES)
def test_video_without_timing(family: str, procs: dict[str, Any]) -> None:
    proc = procs[family]
    prompt = proc.default_multimodal_prompt("q", num_images=0, num_videos=1)
    request = {"prompt": prompt, "multi_modal_data": {"video": _frames(3)}}
    if family in TIMED:
        with pytest.raises(ValueError, match="video 0 has no timing: .* needs the frames' fps"):
            proc(request)
    else:  # Qwen2-VL positions ignore time, so untimed frames are fine
        ids, _ = proc(request)
        assert proc.video_token_id in ids


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_image_too_large_without_resize(
    family: str, ckpts: dict[str, Path], procs: dict[str, Any], tmp_path: Path
) -> None:
    proc = procs[family]
    side = proc.patch_size * proc.merge_size * 10  # 100 merged units > max_pixels (64 units)
    pixels = side * side
    request = {
        "prompt": proc.default_multimodal_prompt("q"),
        "multi_modal_data": {"image": _image(side, side)},
    }
    match = f"{pixels} pixels exceeds max_pixels={proc.max_pixels}.*do_resize=False"
    with pytest.raises(ValueError, match=match):
        proc({**request, "mm_processor_kwargs": {"do_resize": False}})
    folder = shutil.copytree(ckpts[family], tmp_path / "noresize")
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**cfg, "do_resize": False}))
    with pytest.raises(ValueError, match=match):
        create_input_processor(folder)(request)


# ------------------------------------------------------------------------------ profiling


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_dummy_image_size(family: str, procs: dict[str, Any]) -> None:
    proc = procs[family]
    factor = proc.patch_size * proc.merge_size
    for budget in (4, 5, 17, 30, 64, 1000):
        width, height = proc.get_dummy_image_size(budget)
        assert width == height and width % factor == 0
        tokens = proc.get_num_tokens_per_image(width, height)
        assert tokens <= budget
        bigger = width + factor
        assert bigger * bigger > proc.max_pixels or (
            proc.get_num_tokens_per_image(bigger, bigger) > budget
        )
        assert proc.get_dummy_image_size(budget) == (width, height)  # deterministic
    with pytest.raises(ValueError, match="max_tokens=3 is below the 4 tokens"):
        proc.get_dummy_image_size(3)
    request = proc.get_dummy_multimodal_prompt(16)
    ids, extra = proc(request)
    assert (
        ids.count(proc.image_token_id)
        == proc.get_num_tokens_per_image(*proc.get_dummy_image_size(16))
        == 16
    )
    assert len(proc.get_dummy_prompt(25)) == 25
