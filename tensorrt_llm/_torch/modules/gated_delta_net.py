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
(`pool.index_copy_(0, slots, states)`). With `ssm_slots` / `conv_slots` ([N] int64), that
state tensor is instead the whole pool and request i owns row `slots[i]`: the layer reads
those rows and writes the final states straight back (the model passes both), which saves
the gather and scatter copies per layer and step. A step packs context requests first, then decode
requests (one token each), as `GatedDeltaNetMetadata` describes; rows of the state tensors
follow the same order. A context request starts from zero state unless its
`has_initial_state` is set (a later chunk of a chunked prefill), so stale slot contents never
leak into a fresh request. Decode rows always continue from their state.

Weights: our `in_proj_qkvz` rows are [q | k | v | z] contiguous and `in_proj_ba` rows [b | a].
Qwen3.5 checkpoints (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) stack straight in
via `GATED_DELTA_NET_FUSED_PROJECTIONS`; Qwen3-Next checkpoints (`in_proj_qkvz`, `in_proj_ba`
grouped per key head) are first rewritten by `convert_qwen3_next_gdn_weights`. With a
tensor-parallel `mapping` a layer holds K/tp key heads with their value heads; every size,
state shape and weight above is then the rank's (`gdn_rank_shards`).
After loading, the post-load step `fuse_in_projections_` may join the two input projections
into one weight (`in_proj_fused`); the forward only reads it (None: two GEMMs).

Kernels (CUDA, unless `TRTLLM_GDN_FUSED=0`): a decode step runs three Triton kernels between the
in_proj and out_proj GEMMs (the conv update of the pool rows, the recurrence with the gates and
the q/k norm, the gated RMSNorm) where the torch path launches ~28 small ones; prefill runs the
varlen Triton conv, and short rows that continue a state (MTP verify rows) the same in-place
recurrence over each row's tokens instead of fla's chunked rule (`gated_delta_net_rows.py`).
Their torch paths are the references (and the CPU path).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..._utils import step_constant
from ...mapping import Mapping as ParallelMapping
from .causal_conv1d import CausalConv1d
from .gated_delta_net_metadata import GatedDeltaNetMetadata, StateRows
from .gated_delta_net_rows import QKVPlanes, plane_rows, rows_rule, short_rows_from
from .gated_delta_net_snapshot import split_prefill_rule, varlen_rule, write_conv_snapshots
from .gated_delta_net_weights import (
    GATED_DELTA_NET_FUSED_PROJECTIONS,
    convert_qwen3_next_gdn_weights,
    fuse_in_projections_,
    gdn_projections,
    gdn_rank_shards,
)
from .gated_delta_rule import fused_recurrent_gated_delta_rule
from .triton_kernels import use_triton
from .triton_kernels.causal_conv1d import causal_conv1d_update_, causal_conv1d_varlen_planes
from .triton_kernels.gated_rms_norm import rms_norm_gated, rms_norm_gated_torch
from .triton_kernels.gdn_decode import gated_delta_rule_decode_, gdn_gates_torch

__all__ = [
    "FUSED_KERNELS_ENV",
    "GATED_DELTA_NET_FUSED_PROJECTIONS",
    "INPLACE_DECODE_ENV",
    "GatedDeltaNet",
    "GatedDeltaNetMetadata",
    "RMSNormGated",
    "convert_qwen3_next_gdn_weights",
    "fuse_gdn_in_projections_",
]

# Decode steps update the SSM pool in place with our Triton kernel (gdn_decode.py) unless this
# is "0" (then: gather the rows, fla's / the torch recurrent step, scatter them back).
INPLACE_DECODE_ENV = "TRTLLM_GDN_INPLACE_DECODE"
# The conv1d (decode update and varlen prefill), the gates and the gated RMSNorm run as Triton
# kernels (triton_kernels/causal_conv1d.py, gdn_decode.py, gated_rms_norm.py) unless this is
# "0" (then: the torch chains, ~25 more small kernels per layer and decode step). The gates
# fuse into the recurrence only with the in-place decode above.
FUSED_KERNELS_ENV = "TRTLLM_GDN_FUSED"


class RMSNormGated(nn.Module):
    """`weight * RMSNorm(x) * silu(gate)` over the last dim; statistics in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """`x, gate: [T, H, D]` -> `[T, H * D]`; backend as `use_triton`'s."""
        if backend == "torch":
            return rms_norm_gated_torch(x, gate, self.weight, self.eps).flatten(-2)
        return rms_norm_gated(x, gate, self.weight, self.eps, backend=backend)


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
        mapping: ParallelMapping | None = None,
    ) -> None:
        super().__init__()
        if min(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim) <= 0:
            raise ValueError("GatedDeltaNet sizes must be positive")
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of {num_k_heads=}")
        mapping = mapping if mapping is not None else ParallelMapping()
        # The checkpoint's head counts (its weight layouts); the attributes below are this
        # tensor-parallel rank's share (gated_delta_net_weights.py: `gdn_rank_shards`).
        self.full_num_k_heads, self.full_num_v_heads = num_k_heads, num_v_heads
        tp = gdn_rank_shards(num_k_heads, num_v_heads, head_k_dim, head_v_dim, mapping)
        if tp is not None:
            num_k_heads, num_v_heads = tp.num_k_heads, tp.num_v_heads
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        # Under tensor parallelism the projections hold this rank's rows (out_proj: its
        # input columns, one all-reduce), conv1d / dt_bias / A_log its channels and heads.
        self.in_proj_qkvz, self.in_proj_ba, self.out_proj = gdn_projections(
            hidden_size, self.conv_dim, self.value_dim, num_v_heads, tp, mapping, dtype
        )
        self.conv1d = CausalConv1d(self.conv_dim, conv_kernel_size, activation="silu", dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, dtype=dtype))
        self.norm = RMSNormGated(head_v_dim, eps=rms_norm_eps, dtype=dtype)  # per head: whole
        if tp is not None:  # the checkpoint slices the loader reads (weight_loading.py)
            self.tp_shards = {"dt_bias": (tp.heads,), "A_log": (tp.heads,)}
            self.conv1d.tp_shards = {"weight": (tp.qkv,), "bias": (tp.qkv,)}
        # Read once here, not on every decode step.
        self.inplace_decode = os.environ.get(INPLACE_DECODE_ENV, "1") != "0"
        # "auto": the Triton kernels on CUDA; tests set "triton" (CPU under TRITON_INTERPRET=1).
        self.kernel_backend = "auto" if os.environ.get(FUSED_KERNELS_ENV, "1") != "0" else "torch"
        # `[in_proj_qkvz; in_proj_ba]` as one weight (both parameters views of it), set by the
        # post-load step `fuse_in_projections_`; None runs the two GEMMs.
        self.in_proj_fused: torch.Tensor | None = None

    @classmethod
    def from_config(
        cls, config: Any, dtype: torch.dtype | None = None, mapping: ParallelMapping | None = None
    ) -> GatedDeltaNet:
        """Build from an HF Qwen3.5 / Qwen3-Next text config (`linear_*` fields); with a
        tensor-parallel `mapping`, this rank's heads."""
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
            mapping=mapping,
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
        conv_slots: torch.Tensor | None,
    ) -> None:
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [T, {self.hidden_size}], got {tuple(hidden_states.shape)}"
            )
        if hidden_states.shape[0] != metadata.num_tokens:
            raise ValueError(
                f"{hidden_states.shape[0]} tokens but the metadata describes {metadata.num_tokens}"
            )
        for name, states, shape, slots in (
            ("conv_states", conv_states, self.conv_state_shape, conv_slots),
            ("ssm_states", ssm_states, self.ssm_state_shape, ssm_slots),
        ):
            want = (metadata.num_seqs if slots is None else states.shape[0], *shape)
            if tuple(states.shape) != want:
                raise ValueError(f"{name} must be {want}, got {tuple(states.shape)}")
            if slots is not None and tuple(slots.shape) != (metadata.num_seqs,):
                raise ValueError(
                    f"{name[:-7]}_slots must be [{metadata.num_seqs}], got {tuple(slots.shape)}"
                )

    def forward(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        metadata: GatedDeltaNetMetadata,
        ssm_slots: torch.Tensor | None = None,
        conv_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; conv_states and ssm_states are updated in place
        (each is the pool addressed by `conv_slots` / `ssm_slots` when those are given)."""
        self._check_inputs(hidden_states, conv_states, ssm_states, metadata, ssm_slots, conv_slots)
        ssm, conv = StateRows(ssm_states, ssm_slots), StateRows(conv_states, conv_slots)
        if metadata.num_tokens == 0:
            return hidden_states.new_empty(0, self.hidden_size)
        fused = use_triton("gated_delta_net", hidden_states.device, self.kernel_backend)
        num_ctx, num_ctx_tokens = metadata.num_contexts, metadata.num_context_tokens
        # Prepared once after loading (`fuse_in_projections_`); read, never decided, here.
        fused_w = self.in_proj_fused
        if fused_w is not None:
            sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
            mixed_qkv, z, b, a = F.linear(hidden_states, fused_w).split(sizes, -1)
        else:
            qkvz = self.in_proj_qkvz(hidden_states)
            mixed_qkv, z = qkvz.split([self.conv_dim, self.value_dim], -1)
            b, a = self.in_proj_ba(hidden_states).chunk(2, dim=-1)
        parts = []
        if num_ctx > 0:
            span = slice(0, num_ctx_tokens)
            if metadata.snapshots:  # before the conv overwrites the initial states it reads
                write_conv_snapshots(mixed_qkv[span], conv.rows(0, num_ctx), metadata)
            planes = self._prefill_conv(mixed_qkv[span], conv.rows(0, num_ctx), metadata, fused)
            # The context rows past `cut` (verify rows after a step's prefill chunks) run in
            # place token by token; the ones before it through the chunked rule.
            cut = short_rows_from(metadata, ssm.slots is not None and self.inplace_decode)
            if cut > 0:
                head = metadata
                if cut < num_ctx:
                    head = replace(
                        metadata,
                        context_lens=metadata.context_lens[:cut],
                        has_initial_state=metadata.has_initial_state[:cut],
                    )
                n_head = head.num_context_tokens
                g, beta = gdn_gates_torch(a[:n_head], b[:n_head], self.A_log, self.dt_bias)
                x_head = plane_rows(planes, slice(0, n_head))
                parts.append(self._prefill_rule(x_head, g, beta, ssm.rows(0, cut), head))
            if cut < num_ctx:
                t0 = metadata.cu_seqlens[cut]
                rest = slice(t0, num_ctx_tokens)
                o = rows_rule(
                    self, mixed_qkv[rest], plane_rows(planes, rest), a[rest], b[rest], conv, ssm,
                    cut, metadata, fused,
                )  # fmt: skip
                parts.append(o)
        if metadata.num_decodes > 0:
            span = slice(num_ctx_tokens, None)
            x = self._decode_conv(mixed_qkv[span], conv.rows(num_ctx, metadata.num_seqs), fused)
            rows = ssm.rows(num_ctx, metadata.num_seqs)
            parts.append(self._decode_rule(x, a[span], b[span], rows, fused))
        core = parts[0] if len(parts) == 1 else torch.cat(parts)
        gate = z.reshape(-1, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(core, gate, "triton" if fused else "torch"))

    def fuse_in_projections_(self) -> bool:
        """The post-load step that joins in_proj_qkvz and in_proj_ba into one GEMM
        (`fuse_in_projections_` of gated_delta_net_weights.py); whether they are joined."""
        return fuse_in_projections_(self)

    def _prefill_conv(
        self, x: torch.Tensor, conv: StateRows, metadata: GatedDeltaNetMetadata, fused: bool
    ) -> QKVPlanes:
        """Context tokens through the conv (SiLU included) as q, k, v planes `[T, width]`;
        writes each request's final state. The Triton path writes each plane contiguous, as
        fla's chunked kernel takes them (else it copies each)."""
        flags = metadata.has_initial_state
        if not fused:
            states = conv.read()
            out = self.conv1d(x, metadata.context_lens, states, flags)
            if conv.slots is not None:  # else `states` was a view of the caller's rows
                conv.write(states)
            q, k, v = out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            return q, k, v
        init = flags_d = None
        if any(flags):
            # A copy: the kernel reads the initial states while it writes the final ones.
            init = conv.read() if conv.slots is not None else conv.read().clone()
            flags_d = step_constant(tuple(int(f) for f in flags), torch.int32, x.device)
        slots = None if conv.slots is None else conv.slots[conv.lo : conv.hi]
        finals = conv.states if slots is not None else conv.read()
        return causal_conv1d_varlen_planes(
            x, self.conv1d.weight[:, 0], self.conv1d.bias, metadata.context_lens,
            init, flags_d, finals, slots, self.conv1d.activation,
            (self.key_dim, 2 * self.key_dim),
        )  # fmt: skip

    def _decode_conv(self, x: torch.Tensor, conv: StateRows, fused: bool) -> torch.Tensor:
        """One token per decode request through the conv, its state shifted in place."""
        if fused:
            # The pool rows themselves (by slot), or the caller's per-request rows.
            slots = None if conv.slots is None else conv.slots[conv.lo : conv.hi]
            states = conv.states if slots is not None else conv.read()
            weight, bias, act = self.conv1d.weight[:, 0], self.conv1d.bias, self.conv1d.activation
            return causal_conv1d_update_(x, weight, bias, states, slots, act)
        states = conv.read()
        out = self.conv1d.step(x, states)
        if conv.slots is not None:
            conv.write(states)
        return out

    def _split_heads(self, x: torch.Tensor | QKVPlanes) -> QKVPlanes:
        """conv output [T, conv_dim] or its q, k, v planes -> q, k [T, Hk, K] and v [T, Hv, V]."""
        if isinstance(x, torch.Tensor):
            q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        else:
            q, k, v = x
        return (
            q.reshape(-1, self.num_k_heads, self.head_k_dim),
            k.reshape(-1, self.num_k_heads, self.head_k_dim),
            v.reshape(-1, self.num_v_heads, self.head_v_dim),
        )

    def _prefill_rule(
        self,
        x: QKVPlanes,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm: StateRows,
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
        if metadata.snapshots:
            tensors = (q, k, v, g, beta)
            in_place = self.inplace_decode
            o, final = split_prefill_rule(varlen_rule, tensors, initial, ssm, metadata, in_place)
        else:
            o, final = varlen_rule(q, k, v, g, beta, initial, metadata.cu_seqlens)
        ssm.write(final)
        return o

    def _decode_rule(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm: StateRows, fused: bool
    ) -> torch.Tensor:
        """One token per request, batched over requests; returns [N, Hv, V]."""
        q, k, v = self._split_heads(x)
        if ssm.slots is not None and self.inplace_decode:
            # Reads and writes the pool rows in place instead of fla's gather -> kernel ->
            # scatter: Qwen3.6-27B at c=32 889 vs 403 tok/s on the H200, and no fla
            # autotuning for each new decode batch size (benchmarks/results/qwen3_6_27b_h200.md).
            slots = ssm.slots[ssm.lo : ssm.hi]
            if fused:  # the gates formed in the kernel too
                gates = (a, b, self.A_log, self.dt_bias)
                return gated_delta_rule_decode_(
                    q, k, v, None, None, ssm.states, slots, gates=gates, backend="triton"
                )
            g, beta = gdn_gates_torch(a, b, self.A_log, self.dt_bias)
            return gated_delta_rule_decode_(q, k, v, g, beta, ssm.states, slots)
        g, beta = gdn_gates_torch(a, b, self.A_log, self.dt_bias)
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
            num_k_heads=self.full_num_k_heads,
            num_v_heads=self.full_num_v_heads,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
        )
        load_hf_weights(self, converted, fused=GATED_DELTA_NET_FUSED_PROJECTIONS)


def fuse_gdn_in_projections_(model: nn.Module) -> int:
    """`fuse_in_projections_` on every Gated DeltaNet layer of `model` (the engine's post-load
    step, `model_build.build_model`); how many joined."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    return sum(fuse_in_projections_(m) for m in layers)
