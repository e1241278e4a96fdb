"""Qwen3.5 / Qwen3.6 hybrid text stacks (dense and MoE): Gated DeltaNet + gated attention;
Qwen3-Next runs on the MoE one (`Qwen3NextForCausalLM`, modeling_qwen3_5.py).

`text_config.layer_types` picks each layer's token mixer: "linear_attention" -> `GatedDeltaNet`,
"full_attention" -> `GatedAttention` (qwen3_next_attention.py: q_proj also emits a per-head
output gate, q/k RMSNorm, partial RoPE: interleaved mRoPE for Qwen3.5, 1-D for Qwen3-Next).
Every RMSNorm outside the DeltaNet scales by `1 + weight`. Under tensor parallelism every
part shards (Qwen3-Next's grouped DeltaNet projections too, `convert_qwen3_next_gdn_weights`).

The model owns the recurrent state of its DeltaNet layers, one entry per seq slot
(`RecurrentStateCache`); a step gathers the rows of its requests by `attn_metadata.seq_slots`,
runs the layers and scatters the rows back. A context request whose KV cache is empty starts
from zero state, so a recycled slot never leaks and later prefill chunks carry their state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from ...mapping import Mapping as ParallelMapping
from ..attention_backend import AttentionMetadata
from ..attention_backend.piecewise import run_split
from ..modules.embedding import Embedding, LMHead
from ..modules.fp8_linear import UnscaledOutput
from ..modules.fused_moe import (
    MoE,
    convert_hf_expert_weights,
    fuse_shared_experts_,
    prepare_fp8_block_experts_,
)
from ..modules.fused_moe.expert_parallel import expert_range, select_local_experts
from ..modules.gated_delta_net import (
    GATED_DELTA_NET_FUSED_PROJECTIONS,
    GatedDeltaNet,
    convert_qwen3_next_gdn_weights,
)
from ..modules.gated_mlp import GatedMLP, mlp_after_norm
from ..weight_loading import DEFAULT_IGNORE, FUSED_PROJECTIONS, load_hf_weights
from .modeling_qwen2 import (
    Qwen2Model,
    Qwen2TextForCausalLM,
    build_rotary_embedding,
    check_tensor_parallel,
)
from .qwen3_next_attention import GatedAttention, ZeroCenteredRMSNorm
from .qwen3_next_recurrent import DeltaNetMixer, RecurrentStateCache, StepRows

if TYPE_CHECKING:
    from .modeling_qwen3_5_mtp import Qwen3_5MTP

# GatedAttention and ZeroCenteredRMSNorm are used from here too (MTP head, tests).
__all__ = [
    "GatedAttention",
    "HybridDecoderLayer",
    "Qwen3_5Model",
    "Qwen3_5MoeModel",
    "Qwen3_5MoeTextForCausalLM",
    "Qwen3_5TextForCausalLM",
    "RecurrentStateCache",
    "ZeroCenteredRMSNorm",
]

_LAYER_TYPES = ("linear_attention", "full_attention")
logger = logging.getLogger(__name__)


def _without_mtp(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the multi-token-prediction tensors (`mtp.*`) of a model built without its MTP
    head, with one log line (never an "unexpected weights" error)."""
    kept = {k: v for k, v in named.items() if not k.startswith("mtp.")}
    if len(kept) < len(named):
        logger.info(
            "skipping %d MTP tensors (mtp.*): multi-token prediction is off (no speculative "
            "decoding)",
            len(named) - len(kept),
        )
    return kept


class HybridDecoderLayer(nn.Module):
    """Pre-norm layer: DeltaNet or gated attention, then a dense or MoE MLP."""

    def __init__(
        self,
        config: Any,
        layer_type: str,
        kv_layer_idx: int,
        *,
        moe: bool,
        attn_backend: str,
        dtype: torch.dtype,
        mapping: ParallelMapping | None = None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet.from_config(config, dtype=dtype, mapping=mapping)
        else:
            self.self_attn = GatedAttention(config, kv_layer_idx, attn_backend, dtype, mapping)
        self.mlp: nn.Module = (
            MoE.from_config(config, dtype=dtype, mapping=mapping)
            if moe
            else GatedMLP(
                config.hidden_size, config.intermediate_size, dtype=dtype, mapping=mapping
            )
        )
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps, dtype=dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps, dtype=dtype)

    def forward(
        self,
        hidden_states: torch.Tensor | UnscaledOutput,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        recurrent: DeltaNetMixer | None,
    ) -> tuple[torch.Tensor | UnscaledOutput, torch.Tensor]:
        """Returns `(mlp_out, residual)`; `recurrent` is given to DeltaNet layers only (their
        split point of piecewise graphs, as attention is the other layers').

        As in `Qwen2DecoderLayer`, the norms hand FP8 readers (the attention's qkv, the dense
        MLP's gate_up) e4m3 rows, and FP8 o_proj/down_proj outputs stay unscaled until the
        next norm; the DeltaNet projections keep 16-bit inputs and outputs.
        """
        linear = self.layer_type == "linear_attention"
        normed, residual = self.input_layernorm.forward_for(
            None if linear else self.self_attn.qkv_proj, hidden_states, residual
        )
        if linear:
            if recurrent is None:
                raise ValueError("a linear-attention layer needs its recurrent state")
            if recurrent.gdn is not self.linear_attn:
                raise ValueError("the recurrent state handed to a layer is another layer's")
            # No reader was given: the norm returned a 16-bit tensor.
            normed16 = cast(torch.Tensor, normed)
            hidden_states = run_split(recurrent, normed16, attn_metadata=attn_metadata)
        else:
            hidden_states = self.self_attn(normed, cos_sin, attn_metadata, defer_output_scale=True)
        return mlp_after_norm(self.post_attention_layernorm, self.mlp, hidden_states, residual)


class Qwen3_5Model(nn.Module):
    """Embedding + hybrid layers + final norm over packed tokens `[T]`."""

    moe: ClassVar[bool] = False

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        attn_backend: str = "vanilla",
        max_num_seq_slots: int = 8,
        mapping: ParallelMapping | None = None,
        ssm_state_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        layer_types = list(getattr(config, "layer_types", None) or [])
        if len(layer_types) != config.num_hidden_layers or any(
            t not in _LAYER_TYPES for t in layer_types
        ):
            raise ValueError(
                f"layer_types must list {config.num_hidden_layers} entries from {_LAYER_TYPES}, "
                f"got {layer_types}"
            )
        self.config = config
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, dtype=dtype, mapping=mapping
        )
        layers, kv_idx = [], 0
        for layer_type in layer_types:
            layers.append(
                HybridDecoderLayer(
                    config,
                    layer_type,
                    kv_idx,
                    moe=self.moe,
                    attn_backend=attn_backend,
                    dtype=dtype,
                    mapping=mapping,
                )
            )
            kv_idx += layer_type == "full_attention"
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = build_rotary_embedding(config)
        gdns = [layer.linear_attn for layer in layers if layer.layer_type == "linear_attention"]
        self.recurrent_states = RecurrentStateCache(gdns, max_num_seq_slots, dtype, ssm_state_dtype)
        # NOTE: plain objects (not submodules): they reach the pools through the cache module
        # at call time, so moving the model to its device moves what they use.
        rows = StepRows()
        self.mixers = [DeltaNetMixer(g, self.recurrent_states, j, rows) for j, g in enumerate(gdns)]

    def piecewise_blocker(self) -> str:
        """Every layer splits at its one mixer (attention or `DeltaNetMixer`); the rest (norms,
        dense MLP or the sync-free MoE block) is row-wise."""
        return ""

    get_cos_sin = Qwen2Model.get_cos_sin

    def forward(
        self,
        attn_metadata: AttentionMetadata,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *,
        cos_sin: torch.Tensor | None = None,
        deepstack_embeds: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states `[T, hidden]`."""
        if deepstack_embeds is not None:
            raise ValueError("Qwen3.5 text stacks take no deepstack embeddings")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.embed_tokens(input_ids.reshape(-1))
        hidden_states = inputs_embeds.reshape(-1, self.config.hidden_size)
        if cos_sin is None:
            if position_ids is None:
                raise ValueError("pass position_ids or a precomputed cos_sin")
            cos_sin = self.get_cos_sin(position_ids)
        # `attn_metadata` is None while the piecewise graphs capture: only the split points
        # (attention, the DeltaNet mixers) read it, and those calls are the runner's then.
        mixers = iter(self.mixers)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            recurrent = next(mixers) if layer.layer_type == "linear_attention" else None
            hidden_states, residual = layer(
                hidden_states, residual, cos_sin, attn_metadata, recurrent
            )
        out, _ = self.norm.forward_for(None, hidden_states, residual)
        return cast(torch.Tensor, out)  # no reader: the norm returns a 16-bit tensor


class Qwen3_5MoeModel(Qwen3_5Model):
    moe: ClassVar[bool] = True


class Qwen3_5TextForCausalLM(Qwen2TextForCausalLM):
    """Hybrid decoder stack + LM head from an HF Qwen3.5 text config (reused by the VL models)."""

    model_cls: ClassVar[type[Qwen3_5Model]] = Qwen3_5Model
    model: Qwen3_5Model
    # NOTE: also tells QwenVLModelBase to pass max_num_seq_slots (sizes the recurrent state).
    is_hybrid: ClassVar[bool] = True

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        attn_backend: str = "vanilla",
        tie_word_embeddings: bool | None = None,
        max_num_seq_slots: int = 8,
        mapping: ParallelMapping | None = None,
        ssm_state_dtype: torch.dtype = torch.float32,
    ) -> None:
        nn.Module.__init__(self)
        check_tensor_parallel(type(self), mapping)
        self.mapping = mapping if mapping is not None else ParallelMapping()
        self.config = config
        self.model = self.model_cls(
            config,
            dtype=dtype,
            attn_backend=attn_backend,
            max_num_seq_slots=max_num_seq_slots,
            mapping=mapping,
            ssm_state_dtype=ssm_state_dtype,
        )
        # The MTP head, set by `with_mtp` (modeling_qwen3_5_mtp.py) before loading; while it
        # is None the checkpoint's `mtp.*` tensors are skipped with one log line.
        self.mtp: Qwen3_5MTP | None = None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype=dtype, mapping=mapping)
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def per_slot_state(self) -> dict[str, torch.Tensor]:
        """The conv and SSM rows of every DeltaNet layer."""
        return {f"recurrent.{n}": b for n, b in self.model.recurrent_states.named_buffers()}

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        rename: Callable[[str], str | None] | None = None,
    ) -> None:
        """HF names (`model.layers.N.linear_attn.*`, `...self_attn.*`, `...mlp.*`, `lm_head`);
        per-expert or stacked MoE weights and Qwen3-Next DeltaNet layouts are converted."""
        named: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():
            target = rename(name) if rename is not None else name
            if target is not None:
                named[target] = tensor
        if self.mtp is None:
            named = _without_mtp(named)
        optional: set[str] = set()
        if self.tie_word_embeddings:
            optional.add("lm_head.weight")
            named.pop("lm_head.weight", None)
        config = self.config
        if self.model_cls.moe:
            num_experts = config.num_experts
            if self.mapping.moe_ep_size > 1:  # this rank's experts only, numbered from 0
                named = select_local_experts(named, num_experts, self.mapping)
                num_experts = expert_range(num_experts, self.mapping)[1]
            named = convert_hf_expert_weights(
                named,
                num_experts=num_experts,
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size,
            )
            prepare_fp8_block_experts_(self, named)  # block-FP8 experts stay FP8
        named = convert_qwen3_next_gdn_weights(
            named,
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
        )
        fused = {**FUSED_PROJECTIONS, **GATED_DELTA_NET_FUSED_PROJECTIONS}
        load_hf_weights(self, named, fused=fused, ignore=DEFAULT_IGNORE, optional=optional)
        if self.model_cls.moe:  # the shared experts join the routed ones (shared_fusion.py)
            fuse_shared_experts_(self)


class Qwen3_5MoeTextForCausalLM(Qwen3_5TextForCausalLM):
    model_cls: ClassVar[type[Qwen3_5Model]] = Qwen3_5MoeModel
