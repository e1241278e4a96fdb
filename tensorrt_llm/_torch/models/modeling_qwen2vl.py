"""Qwen2-VL and Qwen2.5-VL models; the mRoPE step helpers (qwen_vl_mrope.py) and the input
processors (modeling_qwen2vl_inputs.py) re-exported under TensorRT-LLM's import paths."""

from __future__ import annotations

from .modeling_multimodal_utils import VISION_DEVICE_PATHS, compose_device_paths
from .modeling_qwen2 import Qwen2TextForCausalLM

# The input processors, registered with the models below, under TensorRT-LLM's import path
# (`modeling_qwen2vl.Qwen2VLInputProcessorBase`).
from .modeling_qwen2vl_inputs import (  # noqa: F401
    MM_PROCESSOR_KWARGS,
    Qwen2_5VLInputProcessorBase,
    Qwen2VLInputProcessorBase,
    text_only_mrope_config,
)
from .modeling_qwen2vl_vision import Qwen2_5_VisionModel, Qwen2VisionModel
from .modeling_qwen_vl_base import QwenVLModelBase
from .modeling_utils import register_auto_model
from .qwen_vl_mrope import _prepare_qwen_vl_mrope_config, apply_generation_deltas  # noqa: F401


@register_auto_model(
    "Qwen2VLForConditionalGeneration",
    input_processor=Qwen2VLInputProcessorBase,
    config_class="Qwen2VLConfig",
    text_architecture="Qwen2ForCausalLM",
    supports_piecewise=True,
)
class Qwen2VLModel(QwenVLModelBase):
    """Qwen2-VL: Qwen2 text stack with contiguous mRoPE sections + the Qwen2-VL tower."""

    text_model_cls = Qwen2TextForCausalLM
    vision_model_cls = Qwen2VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)


@register_auto_model(
    "Qwen2_5_VLForConditionalGeneration",
    input_processor=Qwen2_5VLInputProcessorBase,
    config_class="Qwen2_5_VLConfig",
    text_architecture="Qwen2ForCausalLM",
    supports_piecewise=True,
)
class Qwen2_5_VLModel(QwenVLModelBase):
    """Qwen2.5-VL: as Qwen2-VL, with the window-attention tower and timed video positions."""

    text_model_cls = Qwen2TextForCausalLM
    vision_model_cls = Qwen2_5_VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
