"""Multi-token prediction (MTP) head of Qwen3.5 / Qwen3.6 (and Qwen3-Next) checkpoints.

The checkpoints publish it under `mtp.*` (transformers has no module for it and drops it):

    e = pre_fc_norm_embedding(embed_tokens(next_ids))     # the token after each position
    h = pre_fc_norm_hidden(hidden_states)                 # the main model's final hidden state
    x = fc(cat(e, h))                                     # [T, 2H] -> [T, H]
    x = layers[step % num_layers](x)                      # one full-attention decoder layer
    logits = lm_head(norm(x))                             # embedding and LM head are shared

Norms are zero-centred (`1 + w`) like the rest of the stack; the decoder layer is the stack's
gated-attention layer with its dense or MoE MLP. Each MTP layer's attention has its own KV
layer index after the main stack's full-attention layers (`first_kv_layer_idx`), so a KV cache
for speculation needs `num_full_attention_layers + num_mtp_layers` layers.

Speculative decoding (`pyexecutor/spec_decode/`) builds the head through `with_mtp` (before
loading) and drafts with `Qwen3_5MTP.forward` (`mtp_drafter.py`). A model without the head
skips the `mtp.*` tensors with one log line (`Qwen3_5TextForCausalLM.load_weights`).

Tensor parallelism: each rank builds its shard of the head with the model's `mapping`. The
decoder layers are the stack's own tensor-parallel layers (a rank's query heads with their
gates, kv heads, MLP columns or experts; one all-reduce after attention and one after the
MLP), so the loader reads only the rank's slices of `mtp.layers.*` (their `tp_shards`). The
norms and `fc` are whole on every rank; embedding and LM head are the target's
vocab-parallel ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ...mapping import Mapping
from ..attention_backend import AttentionMetadata
from ..modules.linear import Linear
from .modeling_qwen3_next import HybridDecoderLayer, ZeroCenteredRMSNorm

if TYPE_CHECKING:
    from .modeling_qwen3_next import Qwen3_5TextForCausalLM


def num_mtp_layers(config: Any) -> int:
    """How many MTP layers an HF text config declares (`mtp_num_hidden_layers`, 0 if none)."""
    return int(getattr(config, "mtp_num_hidden_layers", 0) or 0)


class Qwen3_5MTP(nn.Module):
    """`fc`, the two pre-fc norms, `layers` and `norm`, named as the checkpoints' `mtp.*`."""

    def __init__(
        self,
        config: Any,
        *,
        moe: bool,
        first_kv_layer_idx: int,
        attn_backend: str = "vanilla",
        dtype: torch.dtype = torch.float32,
        mapping: Mapping | None = None,
    ) -> None:
        super().__init__()
        num_layers = num_mtp_layers(config)
        if num_layers <= 0:
            raise ValueError(
                "MTP was requested but the text config declares no MTP layers "
                "(mtp_num_hidden_layers)"
            )
        if getattr(config, "mtp_use_dedicated_embeddings", False):
            raise ValueError(
                "mtp_use_dedicated_embeddings=true is not supported: the MTP head shares the "
                "main model's embed_tokens"
            )
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_size = hidden
        # NOTE: replicated under tensor parallelism (no mapping). Its input, cat(e, h), is
        # whole on every rank already and its output is the layer's residual, which every
        # rank holds whole: a replicated fc needs no collective, where a row-parallel one
        # would add an all-reduce to every draft pass to save (tp - 1) / tp of 2 * H^2
        # weights, a small part of the head next to its sharded decoder layer.
        self.fc = Linear(2 * hidden, hidden, bias=False, dtype=dtype)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps, dtype=dtype)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps, dtype=dtype)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(
                config,
                "full_attention",
                first_kv_layer_idx + i,
                moe=moe,
                attn_backend=attn_backend,
                dtype=dtype,
                mapping=mapping,
            )
            for i in range(num_layers)
        )
        self.norm = ZeroCenteredRMSNorm(hidden, eps, dtype=dtype)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        cos_sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        """`inputs_embeds: [T, H]` (embeddings of the next tokens), `hidden_states: [T, H]`
        (the main model's final-normed states), `cos_sin: [T, rotary_dim]` -> final-normed
        MTP hidden states `[T, H]`. Step `k` of a draft uses layer `k % num_layers`."""
        if inputs_embeds.shape != hidden_states.shape or inputs_embeds.shape[-1] != (
            self.hidden_size
        ):
            raise ValueError(
                f"MTP needs inputs_embeds and hidden_states of one shape [T, {self.hidden_size}], "
                f"got {tuple(inputs_embeds.shape)} and {tuple(hidden_states.shape)}"
            )
        embeds = cast(torch.Tensor, self.pre_fc_norm_embedding(inputs_embeds))
        hidden = cast(torch.Tensor, self.pre_fc_norm_hidden(hidden_states))
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        layer = self.layers[spec_step_idx % len(self.layers)]
        out, residual = layer(x, None, cos_sin, attn_metadata, None)
        normed, _ = self.norm.forward_for(None, out, residual)
        return cast(torch.Tensor, normed)  # no reader: the norm returns a 16-bit tensor


def with_mtp(
    lm: Qwen3_5TextForCausalLM, *, attn_backend: str = "vanilla"
) -> Qwen3_5TextForCausalLM:
    """Give a Qwen3.5 text causal LM its MTP head (`lm.mtp`), on the device and in the dtype
    of its embedding, so that `lm.load_weights` loads the checkpoint's `mtp.*` into it.
    Call it before loading; without it those tensors are skipped with one log line. Under
    tensor parallelism the head is this rank's shard (`lm.mapping`)."""
    embed = lm.model.embed_tokens.weight
    num_full = sum(layer.layer_type == "full_attention" for layer in lm.model.layers)
    mtp = Qwen3_5MTP(
        lm.config,
        moe=lm.model_cls.moe,
        first_kv_layer_idx=num_full,
        attn_backend=attn_backend,
        dtype=embed.dtype,
        mapping=lm.mapping,
    )
    lm.mtp = mtp.to(embed.device)
    return lm


def mtp_logits(
    lm: Qwen3_5TextForCausalLM,
    attn_metadata: AttentionMetadata,
    input_ids: torch.Tensor,
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    spec_step_idx: int = 0,
) -> torch.Tensor:
    """Draft logits `[T, vocab]` of a causal LM built with `load_mtp=True`: `input_ids: [T]`
    are the tokens after each position, `hidden_states: [T, H]` the main model's final-normed
    states there, `position_ids` as the main model takes them; embedding, rotary tables and
    LM head are the main model's."""
    if lm.mtp is None:
        raise ValueError("this model was built without its MTP head (see with_mtp)")
    cos_sin = lm.model.get_cos_sin(position_ids)
    embeds = lm.model.embed_tokens(input_ids.reshape(-1))
    out = lm.mtp(embeds, hidden_states, cos_sin, attn_metadata, spec_step_idx)
    return lm.lm_head(out)
