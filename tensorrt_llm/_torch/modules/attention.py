"""Decoder self-attention: fused qkv projection, optional per-head q/k RMSNorm, rotary, backend."""

from __future__ import annotations

import torch
from torch import nn

from ...mapping import Mapping
from ..attention_backend import AttentionMetadata, get_attention_backend
from ..attention_backend.piecewise import run_attention
from ..distributed import TensorShard, column_shard, kv_head_shard
from .fp8_linear import Fp8Activation, UnscaledOutput
from .linear import Linear
from .rms_norm import RMSNorm
from .tensor_parallel import TensorParallelMode
from .triton_kernels.mrope import rope_qk_


class Attention(nn.Module):
    """GQA self-attention over packed tokens.

    `qkv_proj` holds HF's q_proj, k_proj, v_proj rows in that order (biases too, for Qwen2).
    `qk_norm` adds Qwen3's per-head RMSNorm on q and k, applied before the rotary.
    The rotary angles come in from the model as packed `cos_sin: [T, rotary_dim]`; with
    `rotary_dim < head_dim` only the first `rotary_dim` channels of each head rotate.

    Tensor parallelism: each rank holds `num_heads / tp` query heads and their kv heads (a kv
    head is replicated on several ranks when there are fewer kv heads than ranks); qkv_proj is
    column-parallel and o_proj row-parallel, so the layer all-reduces once. `num_heads` and
    `num_kv_heads` are the full model's; the attributes hold this rank's.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        attn_backend: str = "vanilla",
        dtype: torch.dtype | None = None,
        mapping: Mapping | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
        mapping = mapping if mapping is not None else Mapping()
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        shards = None
        if mapping.has_tp:
            tp, rank = mapping.tp_size, mapping.tp_rank
            q_shard = column_shard(num_heads, tp, rank, "num_attention_heads")
            kv_rows, num_kv_heads = kv_head_shard(num_kv_heads, head_dim, tp, rank)
            num_heads = q_shard.length
            q_rows = TensorShard(0, q_shard.start * head_dim, num_heads * head_dim)
            shards = (q_rows, kv_rows, kv_rows)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = Linear(
            hidden_size,
            full_q + 2 * full_kv,
            bias=qkv_bias,
            dtype=dtype,
            output_splits=(full_q, full_kv, full_kv),
            mapping=mapping,
            tensor_parallel_mode=TensorParallelMode.COLUMN,
            output_shards=shards,
        )
        self.o_proj = Linear(
            full_q,
            hidden_size,
            bias=o_bias,
            dtype=dtype,
            mapping=mapping,
            tensor_parallel_mode=TensorParallelMode.ROW,
        )
        self.q_norm = RMSNorm(head_dim, rms_norm_eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps, dtype=dtype) if qk_norm else None
        backend_cls = get_attention_backend(attn_backend)
        self.attn = backend_cls(num_heads, num_kv_heads, head_dim, layer_idx, head_dim**-0.5)

    def forward(
        self,
        hidden_states: torch.Tensor | Fp8Activation,
        cos_sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        defer_output_scale: bool = False,
    ) -> torch.Tensor | UnscaledOutput:
        """`hidden_states: [T, hidden]` (or its FP8 rows), `cos_sin: [T, rotary_dim]` ->
        `[T, hidden]`; with `defer_output_scale`, an FP8 o_proj may return its output
        unscaled (`Linear.forward_deferred`) for the next norm to scale on load."""
        num_tokens = hidden_states.shape[0]
        if cos_sin.shape[0] != num_tokens:
            raise ValueError(f"cos_sin has {cos_sin.shape[0]} rows for {num_tokens} tokens")
        if cos_sin.shape[-1] > self.head_dim:
            raise ValueError(f"rotary_dim {cos_sin.shape[-1]} exceeds head_dim {self.head_dim}")
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        # In place: one fused Triton kernel on CUDA (with the per-head q/k RMSNorm folded in
        # when the model has one), the torch reference (norm, then rotation) elsewhere.
        if self.q_norm is not None and self.k_norm is not None:
            q, k = rope_qk_(
                q, k, cos_sin, self.head_dim,
                q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight,
                norm_eps=self.q_norm.eps,
            )  # fmt: skip
        else:
            q, k = rope_qk_(q, k, cos_sin, self.head_dim)
        # v stays a strided slice of qkv: the backends read rows by stride (no copy kernel).
        out = run_attention(
            self.attn,
            q.reshape(num_tokens, self.q_size),
            k.reshape(num_tokens, self.kv_size),
            v,
            attn_metadata,
        )
        return self.o_proj.forward_deferred(out) if defer_output_scale else self.o_proj(out)
