"""Qwen3.5 / Qwen3.6 (dense, MoE): the vision-language models, the image-bench route and the
text-only causal LMs.

The VL models use the Qwen3-VL vision tower without deepstack (the Qwen3.5 tower only has the
final merger) on a hybrid DeltaNet/attention text stack (modeling_qwen3_next.py). The
image-bench route is the dense model under its own name (its checkpoints carry the legacy
vision model_type, see `config_utils`).
"""

from __future__ import annotations

from typing import Any

from ...inputs.registry import TextInputProcessor
from .modeling_multimodal_utils import VISION_DEVICE_PATHS, compose_device_paths
from .modeling_qwen3_next import Qwen3_5MoeTextForCausalLM, Qwen3_5TextForCausalLM
from .modeling_qwen3vl import Qwen3VLInputProcessorBase
from .modeling_qwen3vl_vision import Qwen3VisionModel
from .modeling_qwen_vl_base import QwenVLModelBase
from .modeling_utils import ModelConfig, register_auto_model


@register_auto_model(
    "Qwen3_5ForConditionalGeneration",
    input_processor=Qwen3VLInputProcessorBase,
    config_class="Qwen3_5Config",
    text_architecture="Qwen3_5ForCausalLM",
    supports_piecewise=True,
)
class Qwen3_5VLModel(QwenVLModelBase):
    """Qwen3.5 / Qwen3.6 dense: hybrid text stack, Qwen3-VL tower, no deepstack."""

    text_model_cls = Qwen3_5TextForCausalLM
    vision_model_cls = Qwen3VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack = False


@register_auto_model(
    "Qwen3_5MoeForConditionalGeneration",
    input_processor=Qwen3VLInputProcessorBase,
    config_class="Qwen3_5MoeConfig",
    text_architecture="Qwen3_5MoeForCausalLM",
    supports_piecewise=True,
)
class Qwen3_5MoeVLModel(QwenVLModelBase):
    """Qwen3.5 / Qwen3.6 MoE: hybrid text stack with MoE layers, no deepstack."""

    text_model_cls = Qwen3_5MoeTextForCausalLM
    vision_model_cls = Qwen3VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack = False


# NOTE: config_utils routes image-bench checkpoints here by their vision model_type.
@register_auto_model(
    "QwenImageBenchForConditionalGeneration",
    input_processor=Qwen3VLInputProcessorBase,
    config_class="Qwen3_5Config",
    text_architecture="Qwen3_5ForCausalLM",
    supports_piecewise=True,
)
class QwenImageBenchModel(QwenVLModelBase):
    """Image-bench checkpoints: the Qwen3.5 dense model under its own route."""

    text_model_cls = Qwen3_5TextForCausalLM
    vision_model_cls = Qwen3VisionModel
    multimodal_data_device_paths = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack = False


def _text_kwargs(model_config: ModelConfig) -> dict[str, Any]:
    return {
        "dtype": model_config.torch_dtype,
        "attn_backend": model_config.attn_backend,
        "max_num_seq_slots": model_config.max_num_seq_slots,
        "mapping": model_config.mapping,
        "ssm_state_dtype": model_config.ssm_state_dtype,
    }


@register_auto_model(
    "Qwen3_5ForCausalLM",
    input_processor=TextInputProcessor,
    config_class="Qwen3_5TextConfig",
    supports_piecewise=True,
)
class Qwen3_5ForCausalLM(Qwen3_5TextForCausalLM):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config.pretrained_config, **_text_kwargs(model_config))
        self.model_config = model_config


@register_auto_model(
    "Qwen3_5MoeForCausalLM",
    input_processor=TextInputProcessor,
    config_class="Qwen3_5MoeTextConfig",
    supports_piecewise=True,
)
class Qwen3_5MoeForCausalLM(Qwen3_5MoeTextForCausalLM):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config.pretrained_config, **_text_kwargs(model_config))
        self.model_config = model_config


def check_qwen3_next_config(config: Any) -> None:
    """Qwen3-Next runs on the Qwen3.5-MoE stack, whose layers are all MoE: the settings
    that would give some layers a dense MLP are refused by name (the releases use none)."""
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    if dense:
        raise ValueError(f"Qwen3-Next with dense MLP layers (mlp_only_layers={dense}) is not built")
    step = int(getattr(config, "decoder_sparse_step", 1))
    if step != 1:
        raise ValueError(f"Qwen3-Next with decoder_sparse_step={step} (only 1: every layer MoE)")
    if int(getattr(config, "num_experts", 0)) <= 0:
        raise ValueError("Qwen3-Next with num_experts=0 (dense) is not built")


@register_auto_model(
    "Qwen3NextForCausalLM",
    input_processor=TextInputProcessor,
    config_class="Qwen3NextConfig",
    supports_piecewise=False,
)
class Qwen3NextForCausalLM(Qwen3_5MoeTextForCausalLM):
    """Qwen3-Next: the Qwen3.5-MoE hybrid stack with 1-D partial RoPE; its DeltaNet
    projections come grouped per key head (`qwen3_next_weights.py` regroups them, each
    tensor-parallel rank reading only its groups)."""

    def __init__(self, model_config: ModelConfig) -> None:
        check_qwen3_next_config(model_config.pretrained_config)
        super().__init__(model_config.pretrained_config, **_text_kwargs(model_config))
        self.model_config = model_config
