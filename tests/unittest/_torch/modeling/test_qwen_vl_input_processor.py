"""Qwen-VL input processors on tiny checkpoints, checked against the HF processors and models.

Parity targets: pixel values and grids of the HF image processor; the token sequence the HF
processors produce (their own placeholder replacement, tokenized); and the mRoPE positions of
the HF models' get_rope_index.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import transformers
from processor_test_helpers import FAMILIES  # noqa: E402
from processor_test_helpers import frames as _frames  # noqa: E402
from processor_test_helpers import image as _image  # noqa: E402
from transformers import AutoImageProcessor, Qwen2VLProcessor, Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from tensorrt_llm._torch.models.modeling_qwen2vl import (
    Qwen2_5VLInputProcessorBase,
    Qwen2VLInputProcessorBase,
)
from tensorrt_llm._torch.models.modeling_qwen3vl import Qwen3VLInputProcessorBase
from tensorrt_llm.inputs.multimodal import (
    MULTIMODAL_LENGTHS,
    MULTIMODAL_POSITIONS,
    placeholder_spans,
)
from tensorrt_llm.inputs.registry import (
    INPUT_PROCESSOR_REGISTRY,
    TextInputProcessor,
    create_input_processor,
    get_input_processor_class,
)
from tensorrt_llm.inputs.utils import VideoData

PROCESSOR_CLASS = {
    "qwen2_vl": Qwen2VLInputProcessorBase,
    "qwen2_5_vl": Qwen2_5VLInputProcessorBase,
    "qwen3_vl": Qwen3VLInputProcessorBase,
    "qwen3_5": Qwen3VLInputProcessorBase,
}
HF_MODEL = {
    "qwen2_vl": "Qwen2VLModel",
    "qwen2_5_vl": "Qwen2_5_VLModel",
    "qwen3_vl": "Qwen3VLModel",
    "qwen3_5": "Qwen3_5Model",
}


@pytest.fixture(scope="module")
def hf_models(procs: dict[str, Any]) -> dict[str, torch.nn.Module]:
    return {f: getattr(transformers, HF_MODEL[f])(procs[f].config) for f in FAMILIES}


def _hf_positions(model: torch.nn.Module, proc: Any, ids: list[int], mm: dict) -> torch.Tensor:
    ids_t = torch.tensor([ids])
    types = (ids_t == proc.image_token_id).int() + 2 * (ids_t == proc.video_token_id).int()
    kwargs = {
        "image_grid_thw": mm.get("image", {}).get("image_grid_thw"),
        "video_grid_thw": mm.get("video", {}).get("video_grid_thw"),
    }
    if "second_per_grid_ts" in mm.get("video", {}):
        kwargs["second_per_grid_ts"] = mm["video"]["second_per_grid_ts"]
    positions, deltas = model.get_rope_index(ids_t, types, **kwargs)
    return positions, deltas


# ------------------------------------------------------------------------------ registry


def test_registry_picks_the_processor(ckpts: dict[str, Path], procs: dict[str, Any]) -> None:
    for family in FAMILIES:
        assert type(procs[family]) is PROCESSOR_CLASS[family]
    for arch in (
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "QwenImageBenchForConditionalGeneration",
    ):
        assert INPUT_PROCESSOR_REGISTRY[arch] is Qwen3VLInputProcessorBase
    for family in ("qwen2", "qwen3"):
        text = create_input_processor(ckpts[family])
        assert isinstance(text, TextInputProcessor)
        ids, extra = text("hello there")
        assert ids == list(text.tokenizer("hello there")["input_ids"]) and extra == {}
        with pytest.raises(ValueError, match="text-only model .* cannot take \\['image'\\]"):
            text({"prompt": "hi", "multi_modal_data": {"image": [_image(8, 8)]}})
        assert len(text.get_dummy_prompt(37)) == 37


def test_unknown_multimodal_architecture_raises(ckpts: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(ckpts["qwen2_vl"], tmp_path / "odd")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["SomethingVLForConditionalGeneration"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture|no input processor"):
        create_input_processor(folder)
    config = SimpleNamespace(vision_config=object())
    with pytest.raises(ValueError, match="no input processor registered for multimodal"):
        get_input_processor_class("SomethingVLForConditionalGeneration", config)
    assert get_input_processor_class("SomeTextForCausalLM", None) is TextInputProcessor


# ------------------------------------------------------------------------------ images


@pytest.mark.parametrize("family", FAMILIES)
def test_image_parity_and_token_expansion(
    family: str, ckpts: dict[str, Path], procs: dict[str, Any]
) -> None:
    proc = procs[family]
    images = [_image(90, 130), _image(200, 60, seed=1)]
    prompt = proc.default_multimodal_prompt("What is shown?", num_images=2)
    ids, extra = proc({"prompt": prompt, "multi_modal_data": {"image": images}})
    mm = extra["multimodal_data"]
    want = AutoImageProcessor.from_pretrained(ckpts[family], local_files_only=True)(
        images=images, return_tensors="pt"
    )
    assert torch.equal(mm["image"]["pixel_values"], want["pixel_values"])
    assert torch.equal(mm["image"]["image_grid_thw"], want["image_grid_thw"])
    assert set(mm) == {"image", "mrope_config", MULTIMODAL_POSITIONS, MULTIMODAL_LENGTHS}
    # The recorded spans are the runs of image pads in the expanded prompt.
    starts, lengths = placeholder_spans(ids, proc.image_token_id)
    assert mm[MULTIMODAL_POSITIONS]["image"].tolist() == starts
    assert mm[MULTIMODAL_LENGTHS]["image"].tolist() == lengths
    assert len(starts) == 2 and "video" not in mm[MULTIMODAL_POSITIONS]
    # HF's own replacement of each placeholder, then its tokenizer: the ids must agree.
    fake = SimpleNamespace(image_processor=proc.image_processor, image_token="<|image_pad|>")
    parts = prompt.split("<|image_pad|>")
    replaced = parts[0] + "".join(
        Qwen2VLProcessor.replace_image_token(fake, want, i) + part
        for i, part in enumerate(parts[1:])
    )
    assert ids == list(proc.tokenizer(replaced)["input_ids"])
    grid = want["image_grid_thw"]
    assert ids.count(proc.image_token_id) == int(grid.prod(-1).sum()) // proc.merge_size**2


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_own_image_pixels_only_for_the_pil_processor_class(
    family: str, ckpts: dict[str, Path], procs: dict[str, Any]
) -> None:
    """The tiny checkpoints load HF's PIL processor: our patchifier replaces its call (the
    test above checks the bits). Any other class, a subclass included, is called as it is."""
    proc = procs[family]
    assert proc.own_image_pixels
    prompt = {
        "prompt": proc.default_multimodal_prompt("hi"),
        "multi_modal_data": {"image": _image(50, 70)},
    }
    refuse = mock.MagicMock(side_effect=AssertionError("HF image processor called"))
    with mock.patch.object(proc, "image_processor", refuse):
        _, ours = proc(prompt)
    calls: list[int] = []

    class RemoteCodeProcessor(type(proc.image_processor)):  # type: ignore[misc]
        def preprocess(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return super().preprocess(*args, **kwargs)

    subclassed = copy.copy(proc.image_processor)
    subclassed.__class__ = RemoteCodeProcessor
    loader = "tensorrt_llm._torch.models.modeling_qwen2vl_inputs.load_image_processor"
    with mock.patch(loader, return_value=subclassed):
        other = type(proc)(str(ckpts[family]), tokenizer=proc.tokenizer)
    assert not other.own_image_pixels
    _, theirs = other(prompt)
    assert calls == [1]
    for key in ("pixel_values", "image_grid_thw"):
        got, want = ours["multimodal_data"]["image"][key], theirs["multimodal_data"]["image"][key]
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_mm_processor_kwargs_pixel_limits(
    family: str, ckpts: dict[str, Path], procs: dict[str, Any]
) -> None:
    proc = procs[family]
    image = _image(300, 300)
    factor = proc.patch_size * proc.merge_size
    prompt = proc.default_multimodal_prompt("hi")
    _, small = proc(
        {
            "prompt": prompt,
            "multi_modal_data": {"image": image},
            "mm_processor_kwargs": {"max_pixels": factor * factor * 4},
        }
    )
    _, large = proc({"prompt": prompt, "multi_modal_data": {"image": image}})
    small_grid = small["multimodal_data"]["image"]["image_grid_thw"][0]
    large_grid = large["multimodal_data"]["image"]["image_grid_thw"][0]
    assert int(small_grid.prod()) // proc.merge_size**2 <= 4 < int(large_grid.prod())
    hf = AutoImageProcessor.from_pretrained(ckpts[family], local_files_only=True)
    size = {"shortest_edge": proc.min_pixels, "longest_edge": factor * factor * 4}
    want = hf(images=[image], size=size, return_tensors="pt")
    assert torch.equal(small["multimodal_data"]["image"]["pixel_values"], want["pixel_values"])


def test_media_forms_give_identical_inputs(procs: dict[str, Any], tmp_path: Path) -> None:
    proc = procs["qwen2_5_vl"]
    image = _image(50, 80)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    png = buf.getvalue()
    path = tmp_path / "img.png"
    path.write_bytes(png)
    b64 = base64.b64encode(png).decode()
    array = np.array(image)
    forms = [
        image,
        torch.from_numpy(array).permute(2, 0, 1),
        str(path),
        path,
        f"data:image/png;base64,{b64}",
        b64,
        png,
        array,
    ]
    prompt = proc.default_multimodal_prompt("hi")
    outs = [proc({"prompt": prompt, "multi_modal_data": {"image": f}}) for f in forms]
    for ids, extra in outs[1:]:
        assert ids == outs[0][0]
        assert torch.equal(
            extra["multimodal_data"]["image"]["pixel_values"],
            outs[0][1]["multimodal_data"]["image"]["pixel_values"],
        )


# ------------------------------------------------------------------------------ mRoPE


@pytest.mark.parametrize("family", FAMILIES)
def test_mrope_config_matches_rope_index_and_hf(
    family: str, procs: dict[str, Any], hf_models: dict[str, torch.nn.Module]
) -> None:
    proc = procs[family]
    prompt = proc.default_multimodal_prompt("Compare them.", num_images=1, num_videos=1)
    # NOTE: transformers 5.x moves text after a vision block on by max(h, w) / merge, while
    # the original Qwen code (and ours) uses the block's max position + 1. The two agree while
    # the temporal extent stays below the spatial one, which this clip (3 temporal patches,
    # 4x4 merged on Qwen2-VL, time index 0,1,2 on Qwen2.5-VL at 4 fps) keeps to.
    video = VideoData(_frames(5, 110, 110), fps=4.0)
    ids, extra = proc(
        {"prompt": prompt, "multi_modal_data": {"image": _image(70, 90), "video": video}}
    )
    mm = extra["multimodal_data"]
    mrope = mm["mrope_config"]
    pos, delta = mrope["mrope_position_ids"], mrope["mrope_position_deltas"]
    assert pos.shape == (3, 1, len(ids)) and pos.dtype == torch.int64 and pos.device.type == "cpu"
    assert delta.shape == (1, 1) and delta.dtype == torch.int32 and delta.device.type == "cpu"
    want_pos, want_delta = type(proc).get_rope_index(
        proc.config,
        torch.tensor([ids]),
        mm["image"]["image_grid_thw"],
        mm["video"]["video_grid_thw"],
        None,
        mm["video"].get("second_per_grid_ts"),
    )
    assert torch.equal(pos, want_pos) and int(delta) == int(want_delta)
    hf_pos, hf_delta = _hf_positions(hf_models[family], proc, ids, mm)
    assert torch.equal(pos, hf_pos) and int(delta) == int(hf_delta.reshape(-1)[0])
    assert int(delta) == int(pos.max()) + 1 - len(ids) < 0


def test_get_mrope_config_dispatches_to_subclass(procs: dict[str, Any]) -> None:
    base = procs["qwen2_vl"]

    class Shifted(Qwen2VLInputProcessorBase):
        @classmethod
        def get_rope_index(cls, model_config: Any, input_ids: Any, *args: Any, **kw: Any) -> Any:
            positions, deltas = super().get_rope_index(model_config, input_ids, *args, **kw)
            return positions + 7, deltas + 7

    proc = copy.copy(base)
    proc.__class__ = Shifted
    ids, extra = base(
        {
            "prompt": base.default_multimodal_prompt("q"),
            "multi_modal_data": {"image": _image(40, 60)},
        }
    )
    grid = extra["multimodal_data"]["image"]["image_grid_thw"]
    want = extra["multimodal_data"]["mrope_config"]
    got = proc.get_mrope_config(ids, grid)
    assert torch.equal(got["mrope_position_ids"], want["mrope_position_ids"] + 7)
    assert int(got["mrope_position_deltas"]) == int(want["mrope_position_deltas"]) + 7


@pytest.mark.parametrize("family", FAMILIES)
def test_text_only_fast_path(family: str, procs: dict[str, Any]) -> None:
    proc = procs[family]
    spy = mock.MagicMock(side_effect=AssertionError("image processor called"))
    with (
        mock.patch.object(proc, "image_processor", spy),
        mock.patch("tensorrt_llm._torch.models.modeling_qwen2vl_inputs.preprocess_frames", spy),
        mock.patch("tensorrt_llm._torch.models.modeling_qwen2vl_inputs.preprocess_images", spy),
    ):
        ids, extra = proc({"prompt": "Just text, no pictures.", "mm_processor_kwargs": {}})
        chat_ids, _ = proc({"prompt": [{"role": "user", "content": "hello"}]})
        token_ids, _ = proc({"prompt_token_ids": ids})
    spy.assert_not_called()
    assert ids == list(proc.tokenizer("Just text, no pictures.")["input_ids"]) == token_ids
    assert chat_ids == list(
        proc.tokenizer(
            proc.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
            )
        )["input_ids"]
    )
    mm = extra["multimodal_data"]
    assert set(mm) == {"mrope_config"}
    pos = mm["mrope_config"]["mrope_position_ids"]
    assert pos.dtype == torch.int64 and pos.shape == (3, 1, len(ids))
    assert torch.equal(pos, torch.arange(len(ids)).expand(3, 1, -1))
    delta = mm["mrope_config"]["mrope_position_deltas"]
    assert delta.dtype == torch.int32 and delta.shape == (1, 1) and int(delta) == 0


# ------------------------------------------------------------------------------ video


@pytest.mark.parametrize("family", FAMILIES)
def test_video_preprocessing(family: str, procs: dict[str, Any]) -> None:
    proc = procs[family]
    fps = 4.0
    prompt = proc.default_multimodal_prompt("What happens?", num_images=0, num_videos=1)
    ids, extra = proc({"prompt": prompt, "multi_modal_data": {"video": VideoData(_frames(5), fps)}})
    video = extra["multimodal_data"]["video"]
    tp, p, m = proc.temporal_patch_size, proc.patch_size, proc.merge_size
    grid = video["video_grid_thw"]
    assert grid.shape == (1, 3) and int(grid[0, 0]) == 3  # 5 frames -> 3 temporal patches
    assert grid.dtype == torch.int64 and int(grid[0, 1]) % m == 0 and int(grid[0, 2]) % m == 0
    assert video["pixel_values_videos"].shape == (int(grid.prod()), 3 * tp * p * p)
    if family == "qwen2_5_vl":
        assert video["second_per_grid_ts"].tolist() == [tp / fps]
    else:
        assert "second_per_grid_ts" not in video
    assert ids.count(proc.video_token_id) == int(grid.prod()) // m**2
    # Spans: one run of pads per video (Qwen2-VL family) or per temporal patch (Qwen3-VL,
    # where timestamp text separates the frames), exactly the pad runs of the prompt.
    mm = extra["multimodal_data"]
    starts, lengths = placeholder_spans(ids, proc.video_token_id)
    assert len(starts) == (3 if isinstance(proc, Qwen3VLInputProcessorBase) else 1)
    assert mm[MULTIMODAL_POSITIONS]["video"].tolist() == starts
    assert mm[MULTIMODAL_LENGTHS]["video"].tolist() == lengths
    # A plain frame list takes its fps from mm_processor_kwargs.
    _, again = proc(
        {
            "prompt": prompt,
            "multi_modal_data": {"video": _frames(5)},
            "mm_processor_kwargs": {"fps": fps},
        }
    )
    assert torch.equal(
        again["multimodal_data"]["video"]["pixel_values_videos"], video["pixel_values_videos"]
    )


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_qwen3_per_frame_timestamps_match_hf(family: str, procs: dict[str, Any]) -> None:
    proc = procs[family]
    fps, n = 2.0, 5
    prompt = proc.default_multimodal_prompt("Describe.", num_images=0, num_videos=1)
    ids, extra = proc({"prompt": prompt, "multi_modal_data": {"video": VideoData(_frames(n), fps)}})
    grid = extra["multimodal_data"]["video"]["video_grid_thw"]
    text = proc.tokenizer.decode(ids)
    assert "<0.2 seconds><|vision_start|>" in text and "<2.0 seconds>" in text
    fake = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=proc.merge_size, temporal_patch_size=2),
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a),
    )
    meta = VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(range(n)))
    replacement = Qwen3VLProcessor.replace_video_token(
        fake, {"video_grid_thw": grid, "video_metadata": [meta]}, 0
    )
    want = proc.tokenizer(prompt.replace("<|video_pad|>", replacement))["input_ids"]
    assert ids == list(want)
    # Explicit timestamps win over fps.
    stamped = VideoData(_frames(n), timestamps=[0.0, 1.0, 2.0, 3.0, 4.0])
    ids2, _ = proc({"prompt": prompt, "multi_modal_data": {"video": stamped}})
    assert "<0.5 seconds>" in proc.tokenizer.decode(ids2)


# ------------------------------------------------------------------------------ chat input


def test_chat_messages_with_embedded_media(procs: dict[str, Any]) -> None:
    proc = procs["qwen3_vl"]
    image = _image(64, 64)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}],
        }
    ]
    ids, extra = proc({"prompt": messages})
    want_ids, want = proc(
        {"prompt": proc.default_multimodal_prompt("What?"), "multi_modal_data": {"image": [image]}}
    )
    assert ids == want_ids
    assert torch.equal(
        extra["multimodal_data"]["image"]["pixel_values"],
        want["multimodal_data"]["image"]["pixel_values"],
    )
    with pytest.raises(ValueError, match="both inside the chat messages and in multi_modal_data"):
        proc({"prompt": messages, "multi_modal_data": {"image": [image]}})


# ------------------------------------------------------------------------------ errors
