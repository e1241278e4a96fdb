"""Qwen3 decoder LLM (also the text stack of Qwen3-VL): Qwen2 plus per-head q/k RMSNorm and
configurable attention biases."""

from __future__ import annotations

from typing import Any, ClassVar

from ...inputs.registry import TextInputProcessor
from .modeling_qwen2 import Qwen2Model, Qwen2TextForCausalLM
from .modeling_utils import ModelConfig, register_auto_model


class Qwen3Model(Qwen2Model):
    qk_norm: ClassVar[bool] = True

    @classmethod
    def projection_biases(cls, config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias


class Qwen3TextForCausalLM(Qwen2TextForCausalLM):
    """Qwen3 decoder stack + LM head from an HF text config (Qwen3Config, Qwen3VLTextConfig)."""

    model_cls: ClassVar[type[Qwen2Model]] = Qwen3Model


@register_auto_model(
    "Qwen3ForCausalLM", input_processor=TextInputProcessor, config_class="Qwen3Config"
)
class Qwen3ForCausalLM(Qwen3TextForCausalLM):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(
            model_config.pretrained_config,
            dtype=model_config.torch_dtype,
            attn_backend=model_config.attn_backend,
            mapping=model_config.mapping,
        )
        self.model_config = model_config
