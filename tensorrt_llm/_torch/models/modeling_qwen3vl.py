"""Qwen3-VL (dense, MoE) and Qwen3.5: input processors, then the models."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .modeling_qwen2vl import Qwen2VLInputProcessorBase
from .qwen_vl_media import sample_indices_qwen3
from .qwen_vl_rope_index import Qwen3VLRopeIndexMixin

# ===================== input processors (Qwen3-VL, Qwen3.5) =====================


class Qwen3VLInputProcessorBase(Qwen3VLRopeIndexMixin, Qwen2VLInputProcessorBase):
    """Qwen3-VL, Qwen3-VL-MoE and Qwen3.5: videos become one vision block per frame.

    Each temporal patch of a video is written as `<{t:.1f} seconds>` text followed by its own
    `<|vision_start|> <|video_pad|>*n <|vision_end|>` block, where t is the mean time of the
    patch's first and last frame, so the model reads frame timing from the text.
    """

    video_needs_timing: ClassVar[bool] = True
    video_budget_over_frames: ClassVar[bool] = True
    default_sample_frames: ClassVar[bool] = True

    def __init__(
        self,
        model_path: str,
        config: Any | None = None,
        tokenizer: Any | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__(model_path, config, tokenizer, trust_remote_code)
        self._timestamp_ids: dict[str, list[int]] = {}

    def _sample_indices(self, total: int, fps: float, num_frames: int | None) -> np.ndarray:
        return sample_indices_qwen3(total, fps, self.video_sampling, num_frames)

    def _video_tokens(
        self, grid: list[int], frame_times: list[float] | None
    ) -> tuple[list[int], list[tuple[int, int]]]:
        t, h, w = grid
        if frame_times is None or len(frame_times) != t:
            raise ValueError(
                f"video with {t} temporal patches needs {t} timestamps, got "
                f"{None if frame_times is None else len(frame_times)}"
            )
        frame_pads = [self.video_token_id] * (h * w // self.merge_size**2)
        out: list[int] = []
        runs: list[tuple[int, int]] = []  # one run of pads per frame, between timestamp texts
        for seconds in frame_times:
            out.extend(self._timestamp_tokens(seconds))
            out.append(self.vision_start_token_id)
            runs.append((len(out), len(frame_pads)))
            out.extend(frame_pads)
            out.append(self.vision_end_token_id)
        return out, runs

    def _timestamp_tokens(self, seconds: float) -> list[int]:
        # NOTE: the text sits between two special tokens in the expanded prompt, so tokenizing
        # it alone gives the same ids as tokenizing the whole expanded string.
        text = f"<{seconds:.1f} seconds>"
        if text not in self._timestamp_ids:
            self._timestamp_ids[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._timestamp_ids[text]


# ===================== models (Qwen3VLModel) =====================

from .modeling_multimodal_utils import VISION_DEVICE_PATHS, compose_device_paths  # noqa: E402
from .modeling_qwen3 import Qwen3TextForCausalLM  # noqa: E402
from .modeling_qwen3vl_vision import Qwen3VisionModel  # noqa: E402
from .modeling_qwen_vl_base import QwenVLModelBase  # noqa: E402
from .modeling_utils import register_auto_model  # noqa: E402


@register_auto_model(
    "Qwen3VLForConditionalGeneration",
    input_processor=Qwen3VLInputProcessorBase,
    config_class="Qwen3VLConfig",
    text_architecture="Qwen3ForCausalLM",
    supports_piecewise=True,
)
class Qwen3VLModel(QwenVLModelBase):
    """Qwen3-VL: Qwen3 text stack with interleaved mRoPE, the Qwen3-VL tower and deepstack."""

    text_model_cls = Qwen3TextForCausalLM
    vision_model_cls = Qwen3VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack = True
