"""Qwen3-VL-MoE: Qwen3-VL with MoE text layers (the Qwen3-MoE stack); it keeps deepstack."""

from __future__ import annotations

from .modeling_multimodal_utils import VISION_DEVICE_PATHS, compose_device_paths
from .modeling_qwen3_moe import Qwen3MoeTextForCausalLM
from .modeling_qwen3vl import Qwen3VLInputProcessorBase
from .modeling_qwen3vl_vision import Qwen3VisionModel
from .modeling_qwen_vl_base import QwenVLModelBase
from .modeling_utils import register_auto_model


@register_auto_model(
    "Qwen3VLMoeForConditionalGeneration",
    input_processor=Qwen3VLInputProcessorBase,
    config_class="Qwen3VLMoeConfig",
    text_architecture="Qwen3MoeForCausalLM",
    supports_piecewise=True,
)
class Qwen3MoeVLModel(QwenVLModelBase):
    """Qwen3-VL-MoE: Qwen3-MoE text stack, Qwen3-VL tower with deepstack."""

    text_model_cls = Qwen3MoeTextForCausalLM
    vision_model_cls = Qwen3VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack = True
