"""The recurrent state of the Gated DeltaNet layers of a hybrid stack (modeling_qwen3_next.py).

The model keeps each DeltaNet layer's conv and SSM state per seq slot (`RecurrentStateCache`).
A step's layer reads its requests' rows by `attn_metadata.seq_slots` and writes them back
(`RecurrentStep`). `DeltaNetMixer` is a layer's call of its mixer as a split point of piecewise
CUDA graphs (`attention_backend/piecewise.run_split`): it builds the step's view from the
metadata it is handed, so the captured pieces never hold per-step state.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..attention_backend import AttentionMetadata
from ..modules.gated_delta_net import GatedDeltaNet, GatedDeltaNetMetadata
from ..seq_slots import slot_rows


class RecurrentStateCache(nn.Module):
    """Conv and SSM state of every DeltaNet layer, one row per seq slot plus a dummy slot.

    NOTE: built with an explicit device so a meta-device build still allocates it; the SSM
    state is `ssm_dtype` whatever the model dtype: float32 by default (it accumulates over the
    whole sequence; the kernels compute in float32 and round once a step when it is 16-bit).
    """

    def __init__(
        self,
        layers: Sequence[GatedDeltaNet],
        max_num_seq_slots: int,
        dtype: torch.dtype,
        ssm_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        rows = slot_rows(max_num_seq_slots)
        self.num_layers = len(layers)
        for j, gdn in enumerate(layers):
            conv = torch.zeros(rows, *gdn.conv_state_shape, dtype=dtype, device="cpu")
            ssm = torch.zeros(rows, *gdn.ssm_state_shape, dtype=ssm_dtype, device="cpu")
            self.register_buffer(f"conv_{j}", conv, persistent=False)
            self.register_buffer(f"ssm_{j}", ssm, persistent=False)

    def pools(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"conv_{j}"), getattr(self, f"ssm_{j}")


@dataclass(frozen=True)
class RecurrentStep:
    """One DeltaNet layer's view of a step: its state pools and the rows the batch uses."""

    conv_pool: torch.Tensor  # [slots + 1, conv_dim, kernel - 1]
    ssm_pool: torch.Tensor  # [slots + 1, Hv, K, V] (float32 by default)
    slots: torch.Tensor  # [num_seqs] int64 on the pools' device, batch order
    metadata: GatedDeltaNetMetadata

    def run(self, gdn: GatedDeltaNet, hidden_states: torch.Tensor) -> torch.Tensor:
        """Run the layer on the batch's rows: it reads and writes both state pools by slot."""
        return gdn(
            hidden_states, self.conv_pool, self.ssm_pool, self.metadata,
            ssm_slots=self.slots, conv_slots=self.slots,
        )  # fmt: skip


def gdn_metadata(attn_metadata: AttentionMetadata) -> GatedDeltaNetMetadata:
    """The DeltaNet view of a step, from host-side fields only (no device sync)."""
    per_request = attn_metadata.tokens_per_generation
    if per_request > 1:
        return _verify_metadata(attn_metadata, per_request)
    num_ctx = attn_metadata.num_contexts
    cached: list[int] = attn_metadata.num_cached_tokens_cpu[:num_ctx].tolist()
    return GatedDeltaNetMetadata(
        context_lens=tuple(attn_metadata.seq_lens_cpu[:num_ctx].tolist()),
        # A fresh request (nothing cached yet) starts from zero even in a recycled slot.
        has_initial_state=tuple(n > 0 for n in cached),
        num_decodes=attn_metadata.num_generations,
        snapshots=attn_metadata.recurrent_snapshots,
        record=attn_metadata.recurrent_record,
    )


def _verify_metadata(attn_metadata: AttentionMetadata, per_request: int) -> GatedDeltaNetMetadata:
    """A verify step's generation rows, `per_request` a request (verify_batch.py), as the
    DeltaNet layers run them: one context row of that many tokens per request, continuing
    its state in place (the rows path of gated_delta_net_rows.py, the same as a verify row
    of a step with context chunks)."""
    rows = attn_metadata.num_generations
    if attn_metadata.num_contexts or rows % per_request:
        raise ValueError(
            f"tokens_per_generation={per_request} needs a step of generation rows only, a "
            f"multiple of it; got {attn_metadata.num_contexts} context and {rows} generation rows"
        )
    n = rows // per_request
    return GatedDeltaNetMetadata(
        context_lens=(per_request,) * n,
        has_initial_state=(True,) * n,
        record=attn_metadata.recurrent_record,
    )


def step_slots(attn_metadata: AttentionMetadata) -> torch.Tensor:
    """The seq slot of each request the DeltaNet layers run (a verify step's first row of
    each request), on the metadata's device."""
    slots = attn_metadata.seq_slots[: attn_metadata.num_seqs]
    per_request = attn_metadata.tokens_per_generation
    return slots if per_request == 1 else slots[::per_request].contiguous()


class StepRows:
    """The DeltaNet view and seq-slot rows of the current step, shared by a stack's mixers:
    built by the first mixer that sees a step's metadata, reused by the others (a step's
    metadata object is new each step and never changed; batch_builder).

    NOTE: the step is known by a weak reference: holding its metadata would keep its KV cache
    manager alive (the capacity probe's, whose memory the real KV cache is sized from)."""

    def __init__(self) -> None:
        self._key: weakref.ref[AttentionMetadata] | None = None
        self._rows: tuple[GatedDeltaNetMetadata, torch.Tensor] | None = None

    def of(
        self, attn_metadata: AttentionMetadata, device: torch.device
    ) -> tuple[GatedDeltaNetMetadata, torch.Tensor]:
        if self._rows is None or self._key is None or self._key() is not attn_metadata:
            slots = step_slots(attn_metadata).to(device)
            self._key = weakref.ref(attn_metadata)
            self._rows = (gdn_metadata(attn_metadata), slots)
        return self._rows


class DeltaNetMixer:
    """One DeltaNet layer as a split point of piecewise graphs (`run_split`): the whole mixer
    (projections, conv, chunked rule, gated norm, out_proj) runs eagerly on the step's real
    rows and metadata, so the pieces around it only hand over `[T, hidden]` in and out; the
    varlen chunk kernels' host-side indices and the per-slot pools stay out of the graphs."""

    def __init__(
        self, gdn: GatedDeltaNet, states: RecurrentStateCache, index: int, rows: StepRows
    ) -> None:
        self.gdn = gdn
        self.states = states
        self.index = index  # among the stack's DeltaNet layers
        self.rows = rows

    def forward(
        self, hidden_states: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`[T, hidden]` -> `[n, hidden]`, n the step's real tokens (T may be a padded
        bucket under piecewise graphs; the rows past n are not run)."""
        meta, slots = self.rows.of(attn_metadata, hidden_states.device)
        if hidden_states.shape[0] > meta.num_tokens:
            hidden_states = hidden_states[: meta.num_tokens]
        conv_pool, ssm_pool = self.states.pools(self.index)
        return RecurrentStep(conv_pool, ssm_pool, slots, meta).run(self.gdn, hidden_states)
