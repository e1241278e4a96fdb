"""Prefix-cache keys over real input-processor output (tiny checkpoints): every placeholder run
is assigned to its item, and block keys diverge exactly at the first block of a changed image."""

from __future__ import annotations

from typing import Any

import pytest
from processor_test_helpers import frames as _frames
from processor_test_helpers import image as _image

from tensorrt_llm._torch.pyexecutor.block_hash import compute_block_keys, media_spans
from tensorrt_llm.inputs.media_hash import (
    MULTIMODAL_HASHES,
    MULTIMODAL_SOURCES,
    hash_multimodal_data,
)
from tensorrt_llm.inputs.multimodal import MULTIMODAL_LENGTHS, MULTIMODAL_POSITIONS
from tensorrt_llm.inputs.utils import VideoData

TPB = 8


def _process(
    proc: Any,
    images: list[Any],
    videos: list[Any],
    kwargs: dict[str, Any] | None = None,
    sources: bool = True,
) -> tuple[list[int], dict[str, Any]]:
    """Ids and multimodal data with the item hashes, as the input preparer makes them (from
    the decoded sources the processor hands over; `sources=False`: the processed pixels)."""
    prompt = proc.default_multimodal_prompt("Compare them.", len(images), len(videos))
    media = {"image": images, "video": videos}
    media = {kind: items for kind, items in media.items() if items}
    request: dict[str, Any] = {"prompt": prompt, "multi_modal_data": media}
    if kwargs:
        request["mm_processor_kwargs"] = kwargs
    ids, extra = proc(request)
    data = extra["multimodal_data"]
    found = extra[MULTIMODAL_SOURCES]
    data[MULTIMODAL_HASHES] = hash_multimodal_data(data, kwargs, found if sources else None)
    return ids, data


def _png(image: Any) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_source_hashes_name_what_the_model_sees(family: str, procs: dict[str, Any]) -> None:
    proc = procs[family]
    img, video = _image(40, 60, 1), VideoData(_frames(5), 4.0)
    _, base = _process(proc, [img], [video])
    hashes = base[MULTIMODAL_HASHES]
    # The decoded sources name the items, not the processed pixels (another digest)...
    _, processed = _process(proc, [img], [video], sources=False)
    assert hashes["image"] != processed[MULTIMODAL_HASHES]["image"]
    # ...and the same picture in another encoding is the same item.
    _, as_png = _process(proc, [_png(img)], [video])
    assert as_png[MULTIMODAL_HASHES] == hashes
    changes = [
        _process(proc, [_image(40, 60, 2)], [video]),  # other pixels
        _process(proc, [img], [VideoData(_frames(5), 2.0)]),  # other frame rate
        _process(proc, [img], [video], {"min_pixels": 8192, "max_pixels": 16384}),  # other resizing
    ]
    for _, data in changes:
        assert data[MULTIMODAL_HASHES] != hashes
    assert changes[0][1][MULTIMODAL_HASHES]["video"] == hashes["video"]


def test_sources_that_do_not_match_the_items_fall_back(procs: dict[str, Any]) -> None:
    proc = procs["qwen2_vl"]
    prompt = proc.default_multimodal_prompt("Compare them.", 2, 0)
    images = [_image(40, 60, 1), _image(50, 30, 2)]
    _, extra = proc({"prompt": prompt, "multi_modal_data": {"image": images}})
    data = extra["multimodal_data"]
    processed = hash_multimodal_data(data)
    assert hash_multimodal_data(data, None, {"image": images[:1]}) == processed
    assert hash_multimodal_data(data, None, {"image": ["not pixels", images[1]]}) == processed


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
