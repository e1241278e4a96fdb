"""Video pixels equal HF's Qwen2-VL video processor on frames that need resizing (issue 13,
defect 10), and the logits of the video parity prompt then match HF on such a size.

HF's video processors need torchvision, which has no wheel for this CPU torch (the PyPI wheel
is built for CUDA torch and fails to import here). So the reference is HF's own video
processor code (`Qwen2VLVideoProcessor._preprocess`: sizes, grouping, fused rescale/normalise,
patchify) run with a stand-in for the three torchvision functions it calls, each written from
torchvision's definition: `resize` on a uint8 tensor on the CPU hands it to `interpolate`
(bicubic, antialias, align_corners=False), anywhere else it resizes in float32, clamps, rounds
and casts back; `normalize` is `(x - mean) / std` per channel.
"""

from __future__ import annotations

import enum
import importlib
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch
import transformers.image_processing_backends as backends
import transformers.video_processing_utils  # noqa: F401  (imported before the stand-in exists)
import transformers.video_utils  # noqa: F401
from PIL import Image
from transformers.image_utils import PILImageResampling, SizeDict

from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.inputs.utils import VideoData
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def _tv_resize(image: torch.Tensor, size: list[int], interpolation: Any, antialias: bool = True):
    shape = image.shape
    flat = image.reshape(-1, *shape[-3:])
    if list(shape[-2:]) == list(size):
        return image
    native = image.dtype == torch.uint8 and image.device.type == "cpu"
    x = flat if native else flat.to(torch.float32)
    out = torch.nn.functional.interpolate(
        x, size=list(size), mode=interpolation.value, antialias=antialias, align_corners=False
    )
    if not native and image.dtype == torch.uint8:
        out = out.clamp_(0, 255).round_().to(torch.uint8)
    return out.reshape(*shape[:-2], *size)


def _tv_normalize(image: torch.Tensor, mean: Any, std: Any, inplace: bool = False):
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image if inplace else image.clone()).sub_(mean).div_(std)


@pytest.fixture
def hf_video_processor(monkeypatch: Any) -> Any:
    """HF's Qwen2VLVideoProcessor class, importable with the torchvision stand-in."""
    functional = types.ModuleType("torchvision.transforms.v2.functional")
    functional.InterpolationMode = InterpolationMode
    functional.resize = _tv_resize
    functional.normalize = _tv_normalize
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    # `import a.b.c as x` reads the attribute chain, so link the stand-in packages.
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["torchvision.transforms"].v2 = sys.modules["torchvision.transforms.v2"]
    sys.modules["torchvision.transforms.v2"].functional = functional
    monkeypatch.setitem(sys.modules, functional.__name__, functional)
    monkeypatch.setattr(backends, "tvF", functional, raising=False)
    mapping = {PILImageResampling.BICUBIC: InterpolationMode.BICUBIC}
    monkeypatch.setattr(backends, "pil_torch_interpolation_mapping", mapping)
    module_name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    module = importlib.import_module(module_name)
    yield module.Qwen2VLVideoProcessor
    sys.modules.pop(module_name, None)  # never leave the stand-in-bound module behind


def _frames(n: int, h: int, w: int) -> list[Image.Image]:
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]


def _hf_pixels(cls: Any, proc: Any, frames: list[Image.Image]) -> tuple[torch.Tensor, Any]:
    cfg = proc.video_config
    video = torch.from_numpy(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2)
    hf = object.__new__(cls)  # only _preprocess's own steps are used, no hub/config loading
    out = hf._preprocess(
        [video.contiguous()],
        do_resize=True,
        size=SizeDict(shortest_edge=cfg.min_pixels, longest_edge=cfg.max_pixels),
        resample=PILImageResampling.BICUBIC,
        do_rescale=cfg.do_rescale,
        rescale_factor=cfg.rescale_factor,
        do_normalize=cfg.do_normalize,
        image_mean=tuple(cfg.image_mean),
        image_std=tuple(cfg.image_std),
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size,
        cap_pixels_per_frame=False,
    )
    return out["pixel_values_videos"], out["video_grid_thw"]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize(("h", "w"), [(45, 100), (61, 37), (200, 150), (30, 30)])
def test_video_pixels_equal_hf_video_processor(
    hf_video_processor: Any, family: str, h: int, w: int
) -> None:
    proc = create_input_processor(get_or_build_demo_checkpoint(family))
    frames = _frames(3, h, w)
    prompt = proc.default_multimodal_prompt("What happens?", num_images=0, num_videos=1)
    _, extra = proc({"prompt": prompt, "multi_modal_data": {"video": VideoData(frames, 2.0)}})
    ours = extra["multimodal_data"]["video"]
    want, grid = _hf_pixels(hf_video_processor, proc, frames)
    assert torch.equal(ours["video_grid_thw"], grid.to(torch.int64))
    # The frames really were resized (the old PIL path differed on exactly these).
    factor = proc.video_config.factor
    assert h % factor or w % factor or h * w > proc.video_config.max_pixels
    assert ours["pixel_values_videos"].dtype == torch.float32
    torch.testing.assert_close(ours["pixel_values_videos"], want, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_video_logits_match_hf_on_resized_frames(
    hf_video_processor: Any, family: str, tmp_path: Any
) -> None:
    """Our engine on our pixels vs the HF model on HF's video-processor pixels."""
    from vl_parity_helpers import admit, build_stack, hf_logits, make_request, release

    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
    from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

    stack = build_stack(family, write_tiny_checkpoint(family, tmp_path))
    frames = _frames(2, 45, 100)  # 45x100 is no multiple of 28: every frame is resized
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hm?"}]}]
    req = make_request(
        stack, 1, {"prompt": messages, "multi_modal_data": {"video": [VideoData(frames, 2.0)]}}
    )
    data = dict(req.hf_inputs)
    pixels, grid = _hf_pixels(hf_video_processor, stack.processor, frames)
    data["video"] = {**data["video"], "pixel_values_videos": pixels, "video_grid_thw": grid}
    ids = list(req.prompt_token_ids)
    admit(stack, req)
    try:
        req.context_chunk_size = req.prompt_len
        ours = stack.engine.forward(ScheduledRequests([req], []), return_context_logits=True)
        torch.testing.assert_close(ours.float(), hf_logits(stack, ids, data), atol=1e-4, rtol=0)
    finally:
        release(stack, req)
