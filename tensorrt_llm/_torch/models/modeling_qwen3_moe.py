"""Qwen3-MoE decoder LLM (also the text stack of Qwen3-VL-MoE): Qwen3 attention, sparse MoE MLP."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from ...inputs.registry import TextInputProcessor
from ...mapping import Mapping as ParallelMapping
from ..modules.fused_moe import MoE, convert_hf_expert_weights, prepare_fp8_block_experts_
from ..modules.fused_moe.expert_parallel import expert_range, select_local_experts
from .modeling_qwen2 import Qwen2Model
from .modeling_qwen3 import Qwen3Model, Qwen3TextForCausalLM
from .modeling_utils import ModelConfig, register_auto_model


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """HF's rule: MoE unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th layer."""
    if layer_idx in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return config.num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeModel(Qwen3Model):
    """Qwen3 stack whose sparse layers swap the dense MLP for `MoE`."""

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        attn_backend: str = "vanilla",
        mapping: ParallelMapping | None = None,
    ) -> None:
        super().__init__(config, dtype=dtype, attn_backend=attn_backend, mapping=mapping)
        for i, layer in enumerate(self.layers):
            if is_sparse_layer(config, i):
                layer.mlp = MoE.from_config(config, dtype=dtype, mapping=mapping)


class Qwen3MoeTextForCausalLM(Qwen3TextForCausalLM):
    """Qwen3-MoE stack + LM head from an HF text config (Qwen3MoeConfig, Qwen3VLMoeTextConfig)."""

    model_cls: ClassVar[type[Qwen2Model]] = Qwen3MoeModel
    # Attention and dense layers tensor-parallel, the routed experts expert-parallel.
    supports_tensor_parallel: ClassVar[bool] = True

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        rename: Callable[[str], str | None] | None = None,
    ) -> None:
        """HF names; per-expert, stacked or transposed-stacked expert weights are accepted."""
        named: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():
            target = rename(name) if rename is not None else name
            if target is not None:
                named[target] = tensor
        num_experts = self.config.num_experts
        mapping = self.mapping
        if mapping.moe_ep_size > 1:
            named = select_local_experts(named, num_experts, mapping)
            num_experts = expert_range(num_experts, mapping)[1]
        named = convert_hf_expert_weights(
            named,
            num_experts=num_experts,
            hidden_size=self.config.hidden_size,
            intermediate_size=self.config.moe_intermediate_size,
        )
        prepare_fp8_block_experts_(self, named)  # block-FP8 experts stay FP8
        super().load_weights(named)


@register_auto_model(
    "Qwen3MoeForCausalLM",
    input_processor=TextInputProcessor,
    config_class="Qwen3MoeConfig",
    supports_piecewise=True,
)
class Qwen3MoeForCausalLM(Qwen3MoeTextForCausalLM):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(
            model_config.pretrained_config,
            dtype=model_config.torch_dtype,
            attn_backend=model_config.attn_backend,
            mapping=model_config.mapping,
        )
        self.model_config = model_config
