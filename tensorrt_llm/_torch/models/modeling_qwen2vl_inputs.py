"""Input processors of Qwen2-VL and Qwen2.5-VL: prompts and media -> token ids, pixels, grids,
placeholder spans and the mRoPE config. Qwen3-VL / Qwen3.5 subclass them (modeling_qwen3vl.py).

The model classes register them (`register_auto_model` in modeling_qwen2vl.py, which also
re-exports them under TensorRT-LLM's module path).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from ...inputs.chat_tokenize import tokenize_chat
from ...inputs.data import TextPrompt, as_prompt_dict
from ...inputs.media_hash import MULTIMODAL_SOURCES
from ...inputs.multimodal import spans_data
from ...inputs.multimodal_loader import media_message
from ...inputs.registry import (
    load_hf_config,
    load_tokenizer,
    render_chat,
)
from ...inputs.utils import (
    MODALITIES,
    VideoData,
    collect_multimodal_data,
    load_image,
    load_video,
    media_from_messages,
)
from ...inputs.validation import MM_PROCESSOR_KWARG_KEYS
from .qwen_vl_dummy_inputs import QwenVLDummyInputsMixin
from .qwen_vl_media import (
    VideoSampling,
    VisionPreprocessConfig,
    group_timestamps,
    load_image_processor,
    pil_image_processor_class,
    preprocess_frames,
    preprocess_images,
    read_json,
    sample_indices_qwen2,
    select_video_frames,
    target_size,
)
from .qwen_vl_rope_index import Qwen2_5VLRopeIndexMixin, Qwen2VLRopeIndexMixin

# Per-request knobs accepted in `mm_processor_kwargs` (anything else is a typo worth an error):
# one list, kept with their type and range checks in inputs/validation.py.
MM_PROCESSOR_KWARGS = MM_PROCESSOR_KWARG_KEYS


def text_only_mrope_config(num_tokens: int) -> dict[str, torch.Tensor]:
    """Positions of a prompt without vision blocks: arange on all three axes, delta 0."""
    positions = torch.arange(num_tokens, dtype=torch.int64).view(1, 1, -1).expand(3, 1, -1)
    return {
        "mrope_position_ids": positions.contiguous(),
        "mrope_position_deltas": torch.zeros(1, 1, dtype=torch.int32),
    }


class Qwen2VLInputProcessorBase(QwenVLDummyInputsMixin, Qwen2VLRopeIndexMixin):
    """Prompt + media -> (token ids, {"multimodal_data": ...}) for Qwen2-VL.

    Images go through our own patchifier when the checkpoint's HF image processor is the PIL
    class it equals bit for bit (the one loaded without torchvision; about half its host time,
    `qwen_vl_image_pixels`), else through the HF processor; videos always through our own
    (`qwen_vl_media`). Each `<|image_pad|>` / `<|video_pad|>` placeholder (one per
    item, as the chat template emits) is expanded to the item's vision-token count.
    """

    # Whether a video must say when its frames were taken (fps or timestamps).
    video_needs_timing: ClassVar[bool] = False
    # Whether `second_per_grid_ts` is part of the video inputs (Qwen2.5-VL).
    emits_second_per_grid_ts: ClassVar[bool] = False
    # Qwen3-VL video resizing spends max_pixels on the whole clip.
    video_budget_over_frames: ClassVar[bool] = False
    # Frame sampling when video_preprocessor_config.json does not say (the HF class default).
    default_sample_frames: ClassVar[bool] = False

    def __init__(
        self,
        model_path: str,
        config: Any | None = None,
        tokenizer: Any | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        self.model_path = str(model_path)
        self.config = config if config is not None else load_hf_config(model_path)
        self.tokenizer = tokenizer or load_tokenizer(model_path, trust_remote_code)
        self.image_processor = load_image_processor(self.model_path, trust_remote_code)
        self.vision_config = VisionPreprocessConfig.from_mapping(self.image_processor)
        # Exactly that class: a subclass (remote code) may change what it computes.
        self.own_image_pixels = type(self.image_processor) is pil_image_processor_class()
        video_json = read_json(Path(model_path) / "video_preprocessor_config.json")
        self.video_config = VisionPreprocessConfig.from_mapping(
            video_json or self.image_processor, budget_over_frames=self.video_budget_over_frames
        )
        self.video_sampling = VideoSampling.from_mapping(
            video_json or {}, do_sample_frames=self.default_sample_frames
        )
        self.image_token_id = self._special_id("image_token_id", "<|image_pad|>")
        self.video_token_id = self._special_id("video_token_id", "<|video_pad|>")
        self.vision_start_token_id = self._special_id("vision_start_token_id", "<|vision_start|>")
        self.vision_end_token_id = self._special_id("vision_end_token_id", "<|vision_end|>")
        self.merge_size = self.vision_config.merge_size
        self.patch_size = self.vision_config.patch_size
        self.temporal_patch_size = self.vision_config.temporal_patch_size
        self.min_pixels = self.vision_config.min_pixels
        self.max_pixels = self.vision_config.max_pixels
        vision = getattr(self.config, "vision_config", None)
        model_merge = getattr(vision, "spatial_merge_size", None)
        if model_merge is not None and int(model_merge) != self.merge_size:
            raise ValueError(
                f"image processor merge_size={self.merge_size} != model spatial_merge_size="
                f"{model_merge} in {model_path}"
            )

    def _special_id(self, name: str, token: str) -> int:
        value = getattr(self.config, name, None)
        if value is None:
            value = self.tokenizer.convert_tokens_to_ids(token)
        if value is None or value == getattr(self.tokenizer, "unk_token_id", None):
            raise ValueError(f"{self.model_path}: no id for {token} (config.{name})")
        return int(value)

    # ------------------------------------------------------------------ entry point
    def __call__(
        self, inputs: TextPrompt | Any, sampling_params: Any = None
    ) -> tuple[list[int], dict[str, Any]]:
        prompt = as_prompt_dict(inputs)
        kwargs = dict(prompt.get("mm_processor_kwargs") or {})
        unknown = sorted(set(kwargs) - MM_PROCESSOR_KWARGS)
        if unknown:
            raise ValueError(
                f"unknown mm_processor_kwargs {unknown}; supported: {sorted(MM_PROCESSOR_KWARGS)}"
            )
        images, videos = self._gather_media(prompt)
        ids = self._prompt_ids(prompt)
        if (images or videos) and isinstance(prompt.get("prompt"), str):
            if not self._num_placeholders(ids):
                # A plain prompt with media and no placeholder: the chat template places one
                # per item (multimodal_loader.py).
                message = media_message(prompt["prompt"], len(images), len(videos))
                ids = tokenize_chat(self.tokenizer, message, prompt.get("chat_template_kwargs"))
        self._check_placeholders(ids, len(images), len(videos))
        if not images and not videos:  # fast path: no image processor, plain positions
            return ids, {"multimodal_data": {"mrope_config": text_only_mrope_config(len(ids))}}
        data: dict[str, Any] = {}
        image_grid = video_grid = seconds = None
        frame_times: list[list[float] | None] = []
        if images:
            data["image"] = self._process_images(images, kwargs)
            image_grid = data["image"]["image_grid_thw"]
        if videos:
            data["video"], frame_times = self._process_videos(videos, kwargs)
            video_grid = data["video"]["video_grid_thw"]
            seconds = data["video"].get("second_per_grid_ts")
        spans: dict[str, tuple[list[int], list[int]]] = {}
        ids = self._expand_placeholders(ids, image_grid, video_grid, frame_times, spans)
        data["mrope_config"] = self.get_mrope_config(
            torch.tensor([ids], dtype=torch.int64), image_grid, video_grid, None, seconds
        )
        # NOTE: the engine merges vision rows by these spans, never by comparing step tokens
        # with the pad ids (a decoding request may sample a pad token).
        data.update(spans_data(spans))
        # The decoded items, for the input preparer's cheaper content hashes (media_hash.py).
        sources = {"image": images, "video": videos}
        return ids, {"multimodal_data": data, MULTIMODAL_SOURCES: sources}

    def _gather_media(self, prompt: dict[str, Any]) -> tuple[list[Image.Image], list[VideoData]]:
        data = collect_multimodal_data(prompt.get("multi_modal_data"))
        if isinstance(prompt.get("prompt"), list):
            embedded = media_from_messages(prompt["prompt"])
            for modality in MODALITIES:
                if embedded[modality] and data[modality]:
                    raise ValueError(
                        f"{modality} inputs given both inside the chat messages "
                        f"and in multi_modal_data; use one"
                    )
                data[modality] = data[modality] or embedded[modality]
        # list[Any]: the loop below fills both through one `out` (Image and VideoData items).
        images: list[Any] = []
        videos: list[Any] = []
        for kind, items, loader, out in (
            ("image", data["image"], load_image, images),
            ("video", data["video"], load_video, videos),
        ):
            for i, item in enumerate(items):
                try:
                    out.append(loader(item))
                except ValueError as exc:
                    raise ValueError(f"{kind} {i}: {exc}") from exc
        return images, videos

    def _prompt_ids(self, prompt: dict[str, Any]) -> list[int]:
        from ...inputs.validation import check_prompt_token_ids

        if "prompt_token_ids" in prompt:
            return check_prompt_token_ids(prompt["prompt_token_ids"])
        text = prompt["prompt"]
        if isinstance(text, list):  # request text never becomes control tokens (role injection)
            return tokenize_chat(self.tokenizer, text, prompt.get("chat_template_kwargs"))
        return list(self.tokenizer(text)["input_ids"])

    def _num_placeholders(self, ids: list[int]) -> int:
        array = np.asarray(ids, dtype=np.int64)
        return int(np.isin(array, (self.image_token_id, self.video_token_id)).sum())

    def _check_placeholders(self, ids: list[int], num_images: int, num_videos: int) -> None:
        array = np.asarray(ids, dtype=np.int64)
        for kind, token_id, given in (
            ("image", self.image_token_id, num_images),
            ("video", self.video_token_id, num_videos),
        ):
            found = int((array == token_id).sum())
            if found != given:
                token = self.tokenizer.convert_ids_to_tokens(token_id)
                raise ValueError(
                    f"placeholder count mismatch: the prompt has {found} {kind} "
                    f"placeholder(s) {token} but {given} {kind}(s) were given; write one "
                    f"<|vision_start|>{token}<|vision_end|> per {kind} in the prompt, or none "
                    f"at all to have the chat template place them"
                )

    # ------------------------------------------------------------------ pixels
    def _process_images(
        self, images: list[Image.Image], kwargs: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        cfg = self.vision_config.with_overrides(kwargs)
        for i, image in enumerate(images):
            try:  # raises for a too-large image the processor may not resize
                target_size(image.height, image.width, cfg)
            except ValueError as exc:
                raise ValueError(f"image {i}: {exc}") from exc
        if self.own_image_pixels:
            pixels, grids = preprocess_images(images, cfg)
            return {"pixel_values": pixels, "image_grid_thw": grids}
        out = self.image_processor(
            images=images,
            do_resize=cfg.do_resize,
            size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
            return_tensors="pt",
        )
        return {
            "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"].to(torch.int64),
        }

    def _process_videos(
        self, videos: list[VideoData], kwargs: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], list[list[float] | None]]:
        cfg = self.video_config.with_overrides(kwargs)
        pixels, grids, seconds_per_grid, frame_times = [], [], [], []
        for i, video in enumerate(videos):
            frames, seconds, sampled_fps = self._select_frames(i, video, kwargs)
            try:
                patches, grid = preprocess_frames(frames, cfg)
            except ValueError as exc:
                raise ValueError(f"video {i}: {exc}") from exc
            pixels.append(patches)
            grids.append(grid)
            # A one-frame clip has no rate; its single temporal index is 0 whatever we pick.
            seconds_per_grid.append(cfg.temporal_patch_size / (sampled_fps or 1.0))
            frame_times.append(
                None if seconds is None else group_timestamps(seconds, cfg.temporal_patch_size)
            )
        out = {
            "pixel_values_videos": torch.cat(pixels),
            "video_grid_thw": torch.tensor(grids, dtype=torch.int64),
        }
        if self.emits_second_per_grid_ts:
            out["second_per_grid_ts"] = torch.tensor(seconds_per_grid, dtype=torch.float32)
        return out, frame_times

    def _select_frames(
        self, index: int, video: VideoData, kwargs: dict[str, Any]
    ) -> tuple[list[Image.Image], list[float] | None, float | None]:
        return select_video_frames(
            index,
            video,
            kwargs,
            owner=type(self).__name__,
            needs_timing=self.video_needs_timing,
            sampling=self.video_sampling,
            sample_indices=self._sample_indices,
        )

    def _sample_indices(self, total: int, fps: float, num_frames: int | None) -> np.ndarray:
        return sample_indices_qwen2(
            total, fps, self.video_sampling, self.video_config.temporal_patch_size, num_frames
        )

    # ------------------------------------------------------------------ tokens and positions
    def _expand_placeholders(
        self,
        ids: list[int],
        image_grid: torch.Tensor | None,
        video_grid: torch.Tensor | None,
        frame_times: list[list[float] | None],
        spans: dict[str, tuple[list[int], list[int]]] | None = None,
    ) -> list[int]:
        """Replace each single placeholder token by the item's full token run, in order.

        `spans` (when given) receives each modality's (starts, lengths) of vision-token runs
        in the expanded prompt, as they are written.
        """
        merge2 = self.merge_size**2
        image_rows = [] if image_grid is None else image_grid.tolist()
        video_rows = [] if video_grid is None else video_grid.tolist()
        found: dict[str, tuple[list[int], list[int]]] = {"image": ([], []), "video": ([], [])}
        out: list[int] = []
        start = next_image = next_video = 0
        array = np.asarray(ids, dtype=np.int64)
        is_slot = (array == self.image_token_id) | (array == self.video_token_id)
        for pos in np.flatnonzero(is_slot).tolist():
            out.extend(ids[start:pos])
            start = pos + 1
            if ids[pos] == self.image_token_id:
                t, h, w = image_rows[next_image]
                found["image"][0].append(len(out))
                found["image"][1].append(t * h * w // merge2)
                out.extend([self.image_token_id] * (t * h * w // merge2))
                next_image += 1
            else:
                tokens, runs = self._video_tokens(video_rows[next_video], frame_times[next_video])
                for offset, length in runs:
                    found["video"][0].append(len(out) + offset)
                    found["video"][1].append(length)
                out.extend(tokens)
                next_video += 1
        out.extend(ids[start:])
        if spans is not None:
            spans.update(found)
        return out

    def _video_tokens(
        self, grid: list[int], frame_times: list[float] | None
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """A video's expanded tokens and its (offset, length) runs of video pads in them."""
        t, h, w = grid
        count = t * h * w // self.merge_size**2
        return [self.video_token_id] * count, [(0, count)]

    def get_mrope_config(
        self,
        input_ids: torch.Tensor | Sequence[int],
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """{mrope_position_ids int64 [3,B,L], mrope_position_deltas int32 [B,1]}, on the CPU."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        ids = ids.view(1, -1) if ids.dim() == 1 else ids
        # NOTE: dispatch through the concrete class so subclass overrides of get_rope_index
        # (and of its _build_temporal_block hook) are the ones used.
        positions, deltas = type(self).get_rope_index(
            self.config, ids, image_grid_thw, video_grid_thw, attention_mask, second_per_grid_ts
        )
        return {
            "mrope_position_ids": positions.to(device="cpu", dtype=torch.int64),
            "mrope_position_deltas": deltas.to(device="cpu", dtype=torch.int32).view(-1, 1),
        }

    # ------------------------------------------------------------------ prompts and profiling
    def default_multimodal_prompt(
        self, question: str, num_images: int = 1, num_videos: int = 0
    ) -> str:
        """A one-turn chat prompt with placeholders for the media, rendered by the template."""
        parts = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
        if getattr(self.tokenizer, "chat_template", None) is not None:
            return render_chat(self.tokenizer, messages)
        block = "<|vision_start|>{}<|vision_end|>"
        return (
            block.format("<|image_pad|>") * num_images
            + block.format("<|video_pad|>") * num_videos
            + question
        )


class Qwen2_5VLInputProcessorBase(Qwen2_5VLRopeIndexMixin, Qwen2VLInputProcessorBase):
    """Qwen2.5-VL: video positions follow wall-clock time, so videos need their fps."""

    video_needs_timing: ClassVar[bool] = True
    emits_second_per_grid_ts: ClassVar[bool] = True
