"""Qwen2 decoder LLM (also the text stack of Qwen2-VL and Qwen2.5-VL).

`Qwen2Model` (decoder stack) and `Qwen2TextForCausalLM` (stack + LM head) are built from an HF
*text* config alone, so the VL models reuse them with `config.text_config`; the registered
`Qwen2ForCausalLM` wraps them for a `ModelConfig`. A text config carrying `mrope_section` (or
of a known VL text type) gets `MRotaryEmbedding`, otherwise `RotaryEmbedding`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch
from torch import nn

from ...inputs.registry import TextInputProcessor
from ...mapping import Mapping as ParallelMapping
from ..attention_backend import AttentionMetadata
from ..modules.attention import Attention
from ..modules.embedding import Embedding, LMHead
from ..modules.fp8_linear import UnscaledOutput
from ..modules.fused_moe import MoE
from ..modules.gated_mlp import GatedMLP, mlp_after_norm
from ..modules.rms_norm import RMSNorm
from ..modules.rotary_embedding import MRotaryEmbedding, RotaryEmbedding, parse_rope_scaling
from ..weight_loading import load_hf_weights
from .modeling_utils import ModelConfig, register_auto_model
from .piecewise_stack import TextPiecewiseMixin

if TYPE_CHECKING:
    from ..input_batch import InputBatch

# text model_type -> (HF default mrope_section, interleaved channels)
_MROPE_DEFAULTS: dict[str, tuple[tuple[int, int, int], bool]] = {
    "qwen2_vl_text": ((16, 24, 24), False),
    "qwen2_5_vl_text": ((16, 24, 24), False),
    "qwen3_vl_text": ((24, 20, 20), True),
    "qwen3_vl_moe_text": ((24, 20, 20), True),
    "qwen3_5_text": ((11, 11, 10), True),
    "qwen3_5_moe_text": ((11, 11, 10), True),
}


def text_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def build_rotary_embedding(config: Any) -> RotaryEmbedding:
    """RoPE for an HF text config: base, partial rotary, YaRN scaling and (m)RoPE sections from
    its `rope_parameters` (transformers 5) or legacy `rope_theta`/`rope_scaling`; a rope_type
    other than default / mrope / yarn is a ValueError (`parse_rope_scaling`)."""
    rope: dict[str, Any] = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    max_positions = int(getattr(config, "max_position_embeddings", 32768))
    scaling = parse_rope_scaling(
        rope, max_positions, getattr(config, "original_max_position_embeddings", None)
    )
    base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    head_dim = text_head_dim(config)
    rotary_dim = int(head_dim * partial)
    default_section, default_interleaved = _MROPE_DEFAULTS.get(
        getattr(config, "model_type", ""), (None, False)
    )
    section = rope.get("mrope_section", default_section)
    if section is None:
        return RotaryEmbedding(head_dim, rotary_dim, base, max_positions, scaling=scaling)
    interleaved = bool(rope.get("mrope_interleaved", default_interleaved))
    return MRotaryEmbedding(
        head_dim, rotary_dim, base, max_positions, section, interleaved, scaling=scaling
    )


class DecoderStack(Protocol):
    """What the causal-LM wrappers and the VL models use of a text decoder stack: `Qwen2Model`
    and its subclasses, and the hybrid `Qwen3_5Model` (no common base class)."""

    embed_tokens: Embedding
    rotary_emb: RotaryEmbedding
    layers: nn.ModuleList

    def get_cos_sin(self, position_ids: torch.Tensor) -> torch.Tensor: ...

    def piecewise_blocker(self) -> str:
        """Why piecewise graphs cannot split this stack at its mixers ("" when they can)."""
        ...

    def __call__(
        self,
        attn_metadata: AttentionMetadata,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *,
        cos_sin: torch.Tensor | None = None,
        deepstack_embeds: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor: ...


def _check_text_config(config: Any) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"only full-attention layers are supported, got layer_types {layer_types}")


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm decoder layer; the residual stream is carried separately (fused add-norm)."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        attn_backend: str,
        dtype: torch.dtype,
        mapping: ParallelMapping | None = None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=text_head_dim(config),
            layer_idx=layer_idx,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            rms_norm_eps=eps,
            attn_backend=attn_backend,
            dtype=dtype,
            mapping=mapping,
        )
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, dtype=dtype, mapping=mapping
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)

    def forward(
        self,
        hidden_states: torch.Tensor | UnscaledOutput,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor | UnscaledOutput, torch.Tensor]:
        """Returns `(mlp_out, residual)`; the layer's full output is their sum (`mlp_out`
        may be an FP8 GEMM output still to be scaled, which the next norm does on load)."""
        # Each norm hands its reader FP8 rows directly when that Linear is FP8 (decode sizes).
        normed, residual = self.input_layernorm.forward_for(
            self.self_attn.qkv_proj, hidden_states, residual
        )
        # FP8 o_proj/down_proj outputs may stay unscaled: the next norm scales them on load.
        hidden_states = self.self_attn(normed, cos_sin, attn_metadata, defer_output_scale=True)
        return mlp_after_norm(self.post_attention_layernorm, self.mlp, hidden_states, residual)


class Qwen2Model(nn.Module):
    """Embedding + decoder layers + final norm, over packed tokens `[T]`."""

    qk_norm: ClassVar[bool] = False

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        attn_backend: str = "vanilla",
        mapping: ParallelMapping | None = None,
    ) -> None:
        super().__init__()
        _check_text_config(config)
        self.config = config
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, dtype=dtype, mapping=mapping
        )
        qkv_bias, o_bias = self.projection_biases(config)
        self.layers = nn.ModuleList(
            Qwen2DecoderLayer(
                config,
                i,
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                qk_norm=self.qk_norm,
                attn_backend=attn_backend,
                dtype=dtype,
                mapping=mapping,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = build_rotary_embedding(config)

    def piecewise_blocker(self) -> str:
        """Each layer's one split point is its attention; the rest must be row-wise: a dense
        MLP or the sync-free MoE block (its routing and grouped GEMM stay on the device)."""
        for i, layer in enumerate(self.layers):
            mlp = getattr(layer, "mlp", None)
            if not isinstance(layer, Qwen2DecoderLayer) or not isinstance(mlp, (GatedMLP, MoE)):
                kind = f"{type(layer).__name__}, {type(mlp).__name__}"
                return f"layer {i} ({kind}) is not a full-attention layer with a dense or MoE MLP"
        return ""

    @classmethod
    def projection_biases(cls, config: Any) -> tuple[bool, bool]:
        """(qkv bias, o_proj bias): Qwen2 always has q/k/v biases and no o_proj bias."""
        return True, False

    # `self: DecoderStack`: it reads only `rotary_emb`, and `Qwen3_5Model` borrows it.
    def get_cos_sin(self: DecoderStack, position_ids: torch.Tensor) -> torch.Tensor:
        """`position_ids: [1,T] | [T]` (RoPE) or `[3,1,T] | [3,T]` (mRoPE) -> `[T, rotary_dim]`."""
        if position_ids.dim() == 3 and position_ids.shape[1] == 1:
            position_ids = position_ids[:, 0]
        elif position_ids.dim() == 2 and position_ids.shape[0] == 1:
            position_ids = position_ids[0]
        if position_ids.dim() == 2 and not isinstance(self.rotary_emb, MRotaryEmbedding):
            raise ValueError("3-axis position_ids given to a model without mRoPE")
        return self.rotary_emb.get_cos_sin(position_ids)

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
        if deepstack_embeds is not None and len(deepstack_embeds) > len(self.layers):
            raise ValueError(
                f"{len(deepstack_embeds)} deepstack embeddings for {len(self.layers)} layers"
            )
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(hidden_states, residual, cos_sin, attn_metadata)
            if deepstack_embeds is not None and i < len(deepstack_embeds):
                # Folded into the residual stream, so it joins the layer output's sum.
                residual = residual + deepstack_embeds[i].to(residual.dtype)
        out, _ = self.norm.forward_for(None, hidden_states, residual)
        return cast(torch.Tensor, out)  # no reader: the norm returns a 16-bit tensor


def check_tensor_parallel(cls: type[Qwen2TextForCausalLM], mapping: ParallelMapping | None) -> None:
    """A ValueError naming the class when it cannot shard over `mapping`'s tp ranks."""
    if mapping is not None and mapping.has_tp and not cls.supports_tensor_parallel:
        raise ValueError(
            f"{cls.__name__} does not support tensor_parallel_size={mapping.tp_size} yet "
            "(tensor parallelism covers the Qwen2, Qwen3, Qwen3-MoE and Qwen3.5 text stacks)"
        )


class Qwen2TextForCausalLM(TextPiecewiseMixin, nn.Module):
    """Decoder stack + LM head from an HF text config (reused by the VL models); piecewise
    prefill graphs where the registration allows (`TextPiecewiseMixin`)."""

    # Subclasses narrow it to their stack's class.
    model_cls: ClassVar[Callable[..., DecoderStack]] = Qwen2Model
    # Capabilities the executor reads (`EngineModel`, engine_model.py).
    uses_mrope: ClassVar[bool] = False
    is_hybrid: ClassVar[bool] = False
    has_vision: ClassVar[bool] = False
    multimodal_data_device_paths: ClassVar[list[str]] = []
    # Whether the stack shards across tensor-parallel ranks.
    supports_tensor_parallel: ClassVar[bool] = True

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        attn_backend: str = "vanilla",
        tie_word_embeddings: bool | None = None,
        mapping: ParallelMapping | None = None,
    ) -> None:
        super().__init__()
        check_tensor_parallel(type(self), mapping)
        self.config = config
        self.mapping = mapping if mapping is not None else ParallelMapping()
        self.model = self.model_cls(config, dtype=dtype, attn_backend=attn_backend, mapping=mapping)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, dtype=dtype, mapping=mapping)
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self,
        attn_metadata: AttentionMetadata,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *,
        cos_sin: torch.Tensor | None = None,
        deepstack_embeds: Sequence[torch.Tensor] | None = None,
        return_context_logits: bool = False,
    ) -> torch.Tensor:
        """Logits `[num_seqs, vocab]` of each request's last token, or `[T, vocab]`."""
        hidden_states = self.model(
            attn_metadata,
            input_ids,
            position_ids,
            inputs_embeds,
            cos_sin=cos_sin,
            deepstack_embeds=deepstack_embeds,
        )
        return self.compute_logits(hidden_states, attn_metadata, return_context_logits)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def forward_batch(self, batch: InputBatch) -> torch.Tensor:
        """The engine's entry point (`EngineModel`): a text LLM reads ids and positions."""
        return self(
            batch.attn_metadata,
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            return_context_logits=batch.return_context_logits,
        )

    def forward_hidden(self, batch: InputBatch) -> torch.Tensor:
        """Final-normed hidden states of every token `[T, hidden]` (prompt logprobs)."""
        return self.model(batch.attn_metadata, batch.input_ids, batch.position_ids)

    def lm_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head over the given rows of hidden states."""
        return self.lm_head(hidden_states)

    def per_slot_state(self) -> dict[str, torch.Tensor]:
        """Device tensors with one row per seq slot plus the dummy slot (none here)."""
        return {}

    def compute_logits(
        self,
        hidden_states: torch.Tensor,
        attn_metadata: AttentionMetadata,
        return_context_logits: bool = False,
    ) -> torch.Tensor:
        """LM head over each request's last token (`[num_seqs, vocab]`), or every token."""
        if not return_context_logits:
            # Device-side offsets: no host sync on the decode path (index_select takes the
            # int32 offsets as they are, so no cast kernel per step).
            last = attn_metadata.cu_seqlens_q[1 : attn_metadata.num_seqs + 1] - 1
            hidden_states = hidden_states.index_select(0, last.to(hidden_states.device))
        return self.lm_head(hidden_states)

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        rename: Callable[[str], str | None] | None = None,
    ) -> None:
        """Load HF-named weights (`model.layers.N...`, `model.embed_tokens`, `model.norm`,
        `lm_head`); `rename` maps other layouts onto these names first."""
        optional: set[str] = set()
        if self.tie_word_embeddings:
            # One tensor under two names; the checkpoint may carry either both or only the
            # embedding, and the embedding wins.
            optional.add("lm_head.weight")
            weights = {
                k: v
                for k, v in weights.items()
                if (rename(k) if rename is not None else k) != "lm_head.weight"
            }
        load_hf_weights(self, weights, rename=rename, optional=optional)


@register_auto_model(
    "Qwen2ForCausalLM", input_processor=TextInputProcessor, config_class="Qwen2Config"
)
class Qwen2ForCausalLM(Qwen2TextForCausalLM):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(
            model_config.pretrained_config,
            dtype=model_config.torch_dtype,
            attn_backend=model_config.attn_backend,
            mapping=model_config.mapping,
        )
        self.model_config = model_config
