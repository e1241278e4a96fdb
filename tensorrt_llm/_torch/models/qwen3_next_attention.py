"""The gated attention of the Qwen3.5 / Qwen3.6 and Qwen3-Next hybrid stacks
(modeling_qwen3_next.py): full attention whose q_proj also emits a per-head output gate,
with zero-centered q/k RMSNorms (`1 + weight`) and partial RoPE. Under tensor parallelism a
rank holds its query heads with their gate rows (one range: q_proj interleaves them per
head) and its kv heads, and o_proj its input columns (one all-reduce).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...mapping import Mapping as ParallelMapping
from ..attention_backend import AttentionMetadata, get_attention_backend
from ..attention_backend.piecewise import run_attention
from ..distributed import TensorShard, column_shard, kv_head_shard
from ..modules.fp8_linear import Fp8Activation, UnscaledOutput
from ..modules.linear import Linear
from ..modules.rms_norm import RMSNorm
from ..modules.tensor_parallel import TensorParallelMode
from ..modules.triton_kernels.mrope import rope_qk_
from .modeling_qwen2 import text_head_dim


class ZeroCenteredRMSNorm(RMSNorm):
    """`y = (1 + weight) * x / rms(x)`, all in float32, then cast back (HF Qwen3.5 rounding).

    With `residual`, normalises `x + residual` and also returns that sum (fused add-norm).
    """

    zero_centered = True


class GatedAttention(nn.Module):
    """Full attention with an output gate: `o_proj(attn(q, k, v) * sigmoid(gate))`.

    `qkv_proj` rows are HF's q_proj (per head: `head_dim` query rows then `head_dim` gate rows),
    then k_proj, v_proj. `kv_layer_idx` counts full-attention layers only (the KV cache has
    no entries for the DeltaNet layers).
    """

    def __init__(
        self,
        config: Any,
        kv_layer_idx: int,
        attn_backend: str,
        dtype: torch.dtype | None,
        mapping: ParallelMapping | None = None,
    ) -> None:
        super().__init__()
        mapping = mapping if mapping is not None else ParallelMapping()
        self.head_dim = hd = text_head_dim(config)
        full_q, full_kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        shards, col, row = None, None, None
        if mapping.has_tp:
            # A rank's query heads with their gate rows: q_proj interleaves them per head
            # ([q_h | gate_h]), so the rank's rows are one range; kv heads as in `Attention`.
            tp, rank = mapping.tp_size, mapping.tp_rank
            q_heads = column_shard(self.num_heads, tp, rank, "num_attention_heads")
            kv_rows, self.num_kv_heads = kv_head_shard(self.num_kv_heads, hd, tp, rank)
            self.num_heads = q_heads.length
            q_rows = TensorShard(0, q_heads.start * 2 * hd, q_heads.length * 2 * hd)
            shards, col, row = (
                (q_rows, kv_rows, kv_rows),
                TensorParallelMode.COLUMN,
                TensorParallelMode.ROW,
            )
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(
            config.hidden_size,
            2 * full_q + 2 * full_kv,
            bias=bias,
            dtype=dtype,
            # q_proj holds q and its output gate; the shards place block-FP8 scales.
            output_splits=(2 * full_q, full_kv, full_kv),
            mapping=mapping,
            tensor_parallel_mode=col,
            output_shards=shards,
        )
        self.o_proj = Linear(
            full_q, config.hidden_size, bias=bias, dtype=dtype, mapping=mapping,
            tensor_parallel_mode=row,
        )  # fmt: skip
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype)
        backend_cls = get_attention_backend(attn_backend)
        self.attn = backend_cls(
            self.num_heads, self.num_kv_heads, self.head_dim, kv_layer_idx, self.head_dim**-0.5
        )

    def forward(
        self,
        hidden_states: torch.Tensor | Fp8Activation,
        cos_sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        defer_output_scale: bool = False,
    ) -> torch.Tensor | UnscaledOutput:
        """With `defer_output_scale`, an FP8 o_proj may return its output unscaled
        (`Linear.forward_deferred`) for the next norm to scale on load."""
        num_tokens = hidden_states.shape[0]
        q_gate, k, v = self.qkv_proj(hidden_states).split(
            [2 * self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q, gate = q_gate.reshape(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        # The zero-centered q/k norms run inside the rope kernel (in place, one launch).
        q, k = rope_qk_(
            q, k, cos_sin, self.head_dim,
            q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight,
            norm_eps=self.q_norm.eps, zero_centered=True,
        )  # fmt: skip
        out = run_attention(
            self.attn,
            q.reshape(num_tokens, self.q_size),
            k.reshape(num_tokens, self.kv_size),
            v,  # a strided slice of qkv; the backends read rows by stride
            attn_metadata,
        )
        out = out * torch.sigmoid(gate.reshape(num_tokens, self.q_size))
        return self.o_proj.forward_deferred(out) if defer_output_scale else self.o_proj(out)
