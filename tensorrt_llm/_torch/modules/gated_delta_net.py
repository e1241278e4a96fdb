"""Gated DeltaNet: the linear-attention layer of Qwen3.5 / Qwen3.6 and Qwen3-Next.

Per token: project to q, k, v (one fused `in_proj_qkvz` also giving the output gate z) and to
beta, a (`in_proj_ba`); run q|k|v through a causal depthwise conv1d with SiLU; normalise q, k
(L2); run the gated delta rule (`gated_delta_rule.py`) with
    beta = sigmoid(b),   g = -exp(A_log) * softplus(a + dt_bias)   (log-decay, <= 0);
then `out_proj(RMSNorm(o) * silu(z))` per value head.

State API (one entry per request, gathered by seq slot by the caller):
    conv_states: [N, conv_dim, kernel - 1]              conv_dim = 2 * key_dim + value_dim
    ssm_states:  [N, num_v_heads, head_k_dim, head_v_dim] (float32 recommended)
`forward(hidden_states, conv_states, ssm_states, metadata)` updates both in place and returns
the layer output. If the caller passed gathered copies it scatters them back to its pool
(`pool.index_copy_(0, slots, states)`). With `ssm_slots` ([N] int64), `ssm_states` is instead
the whole pool and request i owns row `ssm_slots[i]`: the layer reads those rows and writes
the final states straight back, which saves two full copies of the (large, float32) recurrent
state per layer and step. A step packs context requests first, then decode
requests (one token each), as `GatedDeltaNetMetadata` describes; rows of the state tensors
follow the same order. A context request starts from zero state unless its
`has_initial_state` is set (a later chunk of a chunked prefill), so stale slot contents never
leak into a fresh request. Decode rows always continue from their state.

Weights: our `in_proj_qkvz` rows are [q | k | v | z] contiguous and `in_proj_ba` rows [b | a].
Qwen3.5 checkpoints (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) stack straight in
via `GATED_DELTA_NET_FUSED_PROJECTIONS`; Qwen3-Next checkpoints (`in_proj_qkvz`, `in_proj_ba`
grouped per key head) are first rewritten by `convert_qwen3_next_gdn_weights`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..._utils import step_constant
from .causal_conv1d import CausalConv1d
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .linear import Linear
from .triton_kernels.gdn_decode import gated_delta_rule_decode_

# Decode steps update the SSM pool in place with our Triton kernel (gdn_decode.py) unless this
# is "0" (then: gather the rows, fla's / the torch recurrent step, scatter them back).
INPLACE_DECODE_ENV = "TRTLLM_GDN_INPLACE_DECODE"

# our fused projection -> the Qwen3.5 HF projections stacked along the output dim, in order
GATED_DELTA_NET_FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}


class RMSNormGated(nn.Module):
    """`weight * RMSNorm(x) * silu(gate)` over the last dim; statistics in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        # The weight multiplies the input-dtype value, as HF's reference rounds in bf16.
        y = self.weight * x32.to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


@dataclass(frozen=True)
class GatedDeltaNetMetadata:
    """One step's layout, shared by every Gated DeltaNet layer (host data only).

    context_lens: new tokens of each context request this step, in packing order.
    has_initial_state: per context request, whether its state carries over from an earlier chunk.
    num_decodes: generation requests after the context requests, one token each.
    """

    context_lens: tuple[int, ...] = ()
    has_initial_state: tuple[bool, ...] = ()
    num_decodes: int = 0

    def __post_init__(self) -> None:
        if len(self.context_lens) != len(self.has_initial_state):
            raise ValueError(
                f"has_initial_state has {len(self.has_initial_state)} entries for "
                f"{len(self.context_lens)} context requests"
            )
        if any(n <= 0 for n in self.context_lens):
            raise ValueError(f"context_lens must be positive, got {list(self.context_lens)}")
        if self.num_decodes < 0:
            raise ValueError(f"num_decodes must be >= 0, got {self.num_decodes}")

    @property
    def num_contexts(self) -> int:
        return len(self.context_lens)

    @property
    def num_context_tokens(self) -> int:
        return sum(self.context_lens)

    @property
    def num_seqs(self) -> int:
        return self.num_contexts + self.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.num_context_tokens + self.num_decodes

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Context token offsets, `num_contexts + 1` entries starting at 0."""
        offsets = [0]
        for n in self.context_lens:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)


def convert_qwen3_next_gdn_weights(
    weights: Mapping[str, torch.Tensor],
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> dict[str, torch.Tensor]:
    """Rewrite Qwen3-Next `*in_proj_qkvz.weight` / `*in_proj_ba.weight` (rows grouped per key
    head: [q_h, k_h, v_h.., z_h..] and [b_h.., a_h..]) into Qwen3.5's contiguous
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`. Other entries pass through."""
    ratio = num_v_heads // num_k_heads
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition("in_proj_")
        if leaf not in ("qkvz.weight", "ba.weight") or (prefix and not prefix.endswith(".")):
            out[name] = tensor
            continue
        if leaf == "qkvz.weight":
            sizes = [head_k_dim, head_k_dim, ratio * head_v_dim, ratio * head_v_dim]
        else:
            sizes = [ratio, ratio]
        if tensor.dim() != 2 or tensor.shape[0] != num_k_heads * sum(sizes):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}; expected {num_k_heads * sum(sizes)} "
                f"rows for {num_k_heads} key heads"
            )
        grouped = tensor.reshape(num_k_heads, sum(sizes), tensor.shape[1])
        parts = [p.reshape(-1, tensor.shape[1]) for p in grouped.split(sizes, dim=1)]
        if leaf == "qkvz.weight":
            out[prefix + "in_proj_qkv.weight"] = torch.cat(parts[:3])
            out[prefix + "in_proj_z.weight"] = parts[3]
        else:
            out[prefix + "in_proj_b.weight"], out[prefix + "in_proj_a.weight"] = parts
    return out


@dataclass(frozen=True)
class _StateRows:
    """The recurrent states of some of a step's requests: rows `lo:hi` of a per-request tensor
    (`slots` None), or the pool rows `slots[lo:hi]` (read by gather, written by index_copy)."""

    states: torch.Tensor
    slots: torch.Tensor | None
    lo: int = 0
    hi: int | None = None

    def rows(self, lo: int, hi: int) -> _StateRows:
        return _StateRows(self.states, self.slots, lo, hi)

    @property
    def device(self) -> torch.device:
        return self.states.device

    def read(self) -> torch.Tensor:
        if self.slots is None:
            return self.states[self.lo : self.hi]
        return self.states.index_select(0, self.slots[self.lo : self.hi])

    def write(self, final: torch.Tensor) -> None:
        if self.slots is None:
            self.states[self.lo : self.hi].copy_(final)
        else:
            self.states.index_copy_(0, self.slots[self.lo : self.hi], final.to(self.states.dtype))


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer over packed tokens; see the module docstring for the state API."""

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int = 4,
        rms_norm_eps: float = 1e-6,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if min(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim) <= 0:
            raise ValueError("GatedDeltaNet sizes must be positive")
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of {num_k_heads=}")
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.in_proj_qkvz = Linear(
            hidden_size,
            self.conv_dim + self.value_dim,
            dtype=dtype,
            output_splits=(self.conv_dim, self.value_dim),
        )
        self.in_proj_ba = Linear(
            hidden_size, 2 * num_v_heads, dtype=dtype, output_splits=(num_v_heads, num_v_heads)
        )
        self.conv1d = CausalConv1d(self.conv_dim, conv_kernel_size, activation="silu", dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, dtype=dtype))
        self.norm = RMSNormGated(head_v_dim, eps=rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(self.value_dim, hidden_size, dtype=dtype)
        # Read once here, not on every decode step.
        self.inplace_decode = os.environ.get(INPLACE_DECODE_ENV, "1") != "0"

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype | None = None) -> GatedDeltaNet:
        """Build from an HF Qwen3.5 / Qwen3-Next text config (`linear_*` fields)."""
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"GatedDeltaNet supports hidden_act='silu' only, got {act!r}")
        return cls(
            hidden_size=config.hidden_size,
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_kernel_size=config.linear_conv_kernel_dim,
            rms_norm_eps=config.rms_norm_eps,
            dtype=dtype,
        )

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """Per-request conv state: (conv_dim, kernel - 1)."""
        return (self.conv_dim, self.conv_kernel_size - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """Per-request recurrent state: (num_v_heads, head_k_dim, head_v_dim)."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def _check_inputs(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        metadata: GatedDeltaNetMetadata,
        ssm_slots: torch.Tensor | None,
    ) -> None:
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [T, {self.hidden_size}], got {tuple(hidden_states.shape)}"
            )
        if hidden_states.shape[0] != metadata.num_tokens:
            raise ValueError(
                f"{hidden_states.shape[0]} tokens but the metadata describes {metadata.num_tokens}"
            )
        for name, states, shape in (
            ("conv_states", conv_states, self.conv_state_shape),
            ("ssm_states", ssm_states, self.ssm_state_shape),
        ):
            rows = states.shape[0] if name == "ssm_states" and ssm_slots is not None else None
            want = (metadata.num_seqs if rows is None else rows, *shape)
            if tuple(states.shape) != want:
                raise ValueError(f"{name} must be {want}, got {tuple(states.shape)}")
        if ssm_slots is not None and tuple(ssm_slots.shape) != (metadata.num_seqs,):
            raise ValueError(
                f"ssm_slots must be [{metadata.num_seqs}], got {tuple(ssm_slots.shape)}"
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        metadata: GatedDeltaNetMetadata,
        ssm_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; conv_states and ssm_states are updated in place
        (`ssm_states` is the pool addressed by `ssm_slots` when those are given)."""
        self._check_inputs(hidden_states, conv_states, ssm_states, metadata, ssm_slots)
        ssm = _StateRows(ssm_states, ssm_slots)
        if metadata.num_tokens == 0:
            return hidden_states.new_empty(0, self.hidden_size)
        num_ctx, num_ctx_tokens = metadata.num_contexts, metadata.num_context_tokens
        mixed_qkv, z = self.in_proj_qkvz(hidden_states).split([self.conv_dim, self.value_dim], -1)
        b, a = self.in_proj_ba(hidden_states).chunk(2, dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        parts = []
        if num_ctx > 0:
            span = slice(0, num_ctx_tokens)
            x = self.conv1d(
                mixed_qkv[span],
                metadata.context_lens,
                conv_states[:num_ctx],
                metadata.has_initial_state,
            )
            parts.append(self._prefill_rule(x, g[span], beta[span], ssm.rows(0, num_ctx), metadata))
        if metadata.num_decodes > 0:
            span = slice(num_ctx_tokens, None)
            x = self.conv1d.step(mixed_qkv[span], conv_states[num_ctx:])
            rows = ssm.rows(num_ctx, metadata.num_seqs)
            parts.append(self._decode_rule(x, g[span], beta[span], rows))
        core = parts[0] if len(parts) == 1 else torch.cat(parts)
        core = self.norm(core, z.reshape(-1, self.num_v_heads, self.head_v_dim))
        return self.out_proj(core.reshape(-1, self.value_dim))

    def _split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [T, conv_dim] -> q, k [T, Hk, K] and v [T, Hv, V]."""
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(-1, self.num_k_heads, self.head_k_dim),
            k.reshape(-1, self.num_k_heads, self.head_k_dim),
            v.reshape(-1, self.num_v_heads, self.head_v_dim),
        )

    def _prefill_rule(
        self,
        x: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm: _StateRows,
        metadata: GatedDeltaNetMetadata,
    ) -> torch.Tensor:
        """Context requests packed along T (varlen); returns [T_ctx, Hv, V]."""
        q, k, v = self._split_heads(x)
        flags = metadata.has_initial_state
        if all(flags):
            initial: torch.Tensor | None = ssm.read()
        elif not any(flags):
            initial = None
        else:
            carry = step_constant(tuple(flags), torch.bool, ssm.device)
            initial = torch.where(carry[:, None, None, None], ssm.read(), 0)
        o, final = chunk_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            initial,
            True,
            use_qk_l2norm=True,
            cu_seqlens=metadata.cu_seqlens,
        )
        assert final is not None
        ssm.write(final)
        return o[0]

    def _decode_rule(
        self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm: _StateRows
    ) -> torch.Tensor:
        """One token per request, batched over requests; returns [N, Hv, V]."""
        q, k, v = self._split_heads(x)
        if ssm.slots is not None and self.inplace_decode:
            # Reads and writes the pool rows in place instead of fla's gather -> kernel ->
            # scatter: Qwen3.6-27B at c=32 889 vs 403 tok/s on the H200, and no fla
            # autotuning for each new decode batch size (benchmarks/results/qwen3_6_27b_h200.md).
            slots = ssm.slots[ssm.lo : ssm.hi]
            return gated_delta_rule_decode_(q, k, v, g, beta, ssm.states, slots)
        o, final = fused_recurrent_gated_delta_rule(
            q[:, None],
            k[:, None],
            v[:, None],
            g[:, None],
            beta[:, None],
            ssm.read(),
            True,
            use_qk_l2norm=True,
        )
        assert final is not None
        ssm.write(final)
        return o[:, 0]

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load HF weights named relative to this layer (Qwen3.5 or Qwen3-Next layout)."""
        # Imported here: the models package imports the modules, not the other way round.
        from ..weight_loading import load_hf_weights

        converted = convert_qwen3_next_gdn_weights(
            weights,
            num_k_heads=self.num_k_heads,
            num_v_heads=self.num_v_heads,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
        )
        load_hf_weights(self, converted, fused=GATED_DELTA_NET_FUSED_PROJECTIONS)
