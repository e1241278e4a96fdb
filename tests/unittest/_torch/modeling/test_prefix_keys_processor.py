"""Prefix-cache keys over real input-processor output (tiny checkpoints): every placeholder run
is assigned to its item, and block keys diverge exactly at the first block of a changed image."""

from __future__ import annotations

from typing import Any

import pytest
from processor_test_helpers import frames as _frames
from processor_test_helpers import image as _image

from tensorrt_llm._torch.pyexecutor.block_hash import compute_block_keys, media_spans
from tensorrt_llm.inputs.media_hash import MULTIMODAL_HASHES, hash_multimodal_data
from tensorrt_llm.inputs.multimodal import MULTIMODAL_LENGTHS, MULTIMODAL_POSITIONS
from tensorrt_llm.inputs.utils import VideoData

TPB = 8


def _process(proc: Any, images: list[Any], videos: list[Any]) -> tuple[list[int], dict[str, Any]]:
    prompt = proc.default_multimodal_prompt("Compare them.", len(images), len(videos))
    media = {"image": images, "video": videos}
    media = {kind: items for kind, items in media.items() if items}
    ids, extra = proc({"prompt": prompt, "multi_modal_data": media})
    data = extra["multimodal_data"]
    data[MULTIMODAL_HASHES] = hash_multimodal_data(data)
    return ids, data


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_spans_cover_every_run_of_every_item(family: str, procs: dict[str, Any]) -> None:
    proc = procs[family]
    video = VideoData(_frames(5), 4.0)
    _, data = _process(proc, [_image(40, 60, 1), _image(50, 30, 2)], [video])
    spans = media_spans(data, proc.merge_size)
    runs = {
        (int(s), int(n))
        for kind in ("image", "video")
        for s, n in zip(
            data[MULTIMODAL_POSITIONS][kind].tolist(),
            data[MULTIMODAL_LENGTHS][kind].tolist(),
            strict=True,
        )
    }
    assert {(s.start, s.length) for s in spans} == runs
    assert len({s.content_hash for s in spans}) == 3  # two images and one video
    # Qwen3-VL: one run per temporal patch, all carrying the video's hash.
    video_hash = bytes.fromhex(data[MULTIMODAL_HASHES]["video"][0])
    expected_runs = 3 if family == "qwen3_vl" else 1
    assert sum(s.content_hash == video_hash for s in spans) == expected_runs


def test_keys_diverge_at_the_changed_image(procs: dict[str, Any]) -> None:
    proc = procs["qwen2_vl"]
    first = _image(40, 60, 1)
    ids_a, data_a = _process(proc, [first, _image(50, 30, 2)], [])
    ids_b, data_b = _process(proc, [first, _image(50, 30, 3)], [])  # same size, other pixels
    assert ids_a == ids_b  # the token ids alone cannot tell the prompts apart
    keys_a = compute_block_keys(ids_a, TPB, media_spans(data_a, proc.merge_size))
    keys_b = compute_block_keys(ids_b, TPB, media_spans(data_b, proc.merge_size))
    second_start = int(data_a[MULTIMODAL_POSITIONS]["image"][1])
    diverge = second_start // TPB
    assert keys_a[:diverge] == keys_b[:diverge]
    assert all(a != b for a, b in zip(keys_a[diverge:], keys_b[diverge:], strict=True))
    # The same request again: every key matches.
    ids_c, data_c = _process(proc, [first, _image(50, 30, 2)], [])
    assert compute_block_keys(ids_c, TPB, media_spans(data_c, proc.merge_size)) == keys_a
