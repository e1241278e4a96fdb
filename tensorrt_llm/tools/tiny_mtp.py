"""Multi-token-prediction (MTP) weights for tiny Qwen3.5 / Qwen3.6 checkpoints.

The published checkpoints carry `mtp.*` tensors that transformers does not model (it drops them
on load): per MTP layer a full-attention decoder layer of the text stack, plus
`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc` (`[hidden, 2 * hidden]`, applied to
`cat(normed embedding, normed hidden state)`) and a final `norm`, sharing the main model's
embedding and LM head. `HFStyleMTP` builds that layout from transformers' own Qwen3.5 layers,
so the tiny writer gets HF-initialised weights and tests get a reference built from HF code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Families whose text stack has MTP layers in the published checkpoints.
MTP_FAMILIES: tuple[str, ...] = ("qwen3_5", "qwen3_5_moe", "qwen_image_bench")


def _hf_layer_classes(text_config: Any) -> tuple[type, type]:
    """(decoder layer, zero-centred RMSNorm) classes of transformers' Qwen3.5 text stack."""
    if text_config.model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe

        return moe.Qwen3_5MoeDecoderLayer, moe.Qwen3_5MoeRMSNorm
    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense

    return dense.Qwen3_5DecoderLayer, dense.Qwen3_5RMSNorm


class HFStyleMTP(nn.Module):
    """The `mtp.*` module layout, built from transformers' Qwen3.5 classes (names as in the
    published checkpoints). Structure only: the forward lives with its users."""

    def __init__(self, text_config: Any) -> None:
        super().__init__()
        num_layers = int(getattr(text_config, "mtp_num_hidden_layers", 0) or 0)
        if num_layers <= 0:
            raise ValueError("the text config has no MTP layers (mtp_num_hidden_layers)")
        layer_cls, norm_cls = _hf_layer_classes(text_config)
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        # HF's decoder layer reads its mixer from layer_types[layer_idx]: point it at a
        # full-attention layer (every MTP layer is one).
        full = list(text_config.layer_types).index("full_attention")
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.layers = nn.ModuleList(layer_cls(text_config, full) for _ in range(num_layers))
        self.norm = norm_cls(hidden, eps=eps)
        std = float(getattr(text_config, "initializer_range", 0.02))
        # NOTE: outside a PreTrainedModel nothing runs HF's weight init, and the fused expert
        # tensors start uninitialised: draw every matrix here (norms start at zero, 1 + w).
        with torch.no_grad():
            for param in self.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, std)


def mtp_state_dict(family: str, hf_config: Any) -> dict[str, torch.Tensor]:
    """`mtp.*` tensors (transformers-5 expert layout) for a config whose text config sets
    `mtp_num_hidden_layers`; empty when it does not. Uses the global RNG (seed it first)."""
    text_config = getattr(hf_config, "text_config", hf_config)
    if not int(getattr(text_config, "mtp_num_hidden_layers", 0) or 0):
        return {}
    if family not in MTP_FAMILIES:
        raise ValueError(f"MTP weights exist for the families {MTP_FAMILIES}, not {family!r}")
    mtp = HFStyleMTP(text_config)
    return {f"mtp.{name}": t for name, t in mtp.state_dict().items()}
