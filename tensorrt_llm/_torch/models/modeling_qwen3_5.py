"""Qwen3.5 / Qwen3.6 (dense, MoE), image-bench and Qwen3-VL-MoE vision-language models.

All use the Qwen3-VL vision tower. The Qwen3.5 family has no deepstack (its tower only has the
final merger) and a hybrid DeltaNet/attention text stack; Qwen3-VL-MoE is Qwen3-VL with MoE
layers and keeps deepstack. The image-bench route is the Qwen3.5 dense model under its own name
(its checkpoints carry the legacy vision model_type, see `config_utils`).
"""

from __future__ import annotations

from .modeling_multimodal_utils import VISION_DEVICE_PATHS, compose_device_paths
from .modeling_qwen3_moe import Qwen3MoeTextForCausalLM
from .modeling_qwen3_next import Qwen3_5MoeTextForCausalLM, Qwen3_5TextForCausalLM
from .modeling_qwen3vl_vision import Qwen3VisionModel
from .modeling_qwen_vl_base import QwenVLModelBase
from .modeling_utils import register_auto_model


@register_auto_model("Qwen3_5ForConditionalGeneration")
class Qwen3_5VLModel(QwenVLModelBase):
    """Qwen3.5 / Qwen3.6 dense: hybrid text stack, Qwen3-VL tower, no deepstack."""

    text_model_cls = Qwen3_5TextForCausalLM
    vision_model_cls = Qwen3VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack = False


@register_auto_model("Qwen3_5MoeForConditionalGeneration")
class Qwen3_5MoeVLModel(QwenVLModelBase):
    """Qwen3.5 / Qwen3.6 MoE: hybrid text stack with MoE layers, no deepstack."""

    text_model_cls = Qwen3_5MoeTextForCausalLM
    vision_model_cls = Qwen3VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack = False


@register_auto_model("QwenImageBenchForConditionalGeneration")
class QwenImageBenchModel(QwenVLModelBase):
    """Image-bench checkpoints: the Qwen3.5 dense model under its own route."""

    text_model_cls = Qwen3_5TextForCausalLM
    vision_model_cls = Qwen3VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack = False


@register_auto_model("Qwen3VLMoeForConditionalGeneration")
class Qwen3MoeVLModel(QwenVLModelBase):
    """Qwen3-VL-MoE: Qwen3-MoE text stack, Qwen3-VL tower with deepstack."""

    text_model_cls = Qwen3MoeTextForCausalLM
    vision_model_cls = Qwen3VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack = True
