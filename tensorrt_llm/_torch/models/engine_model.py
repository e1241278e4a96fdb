"""What the executor may use of a model: one typed interface, no attribute walks.

Every model class the registry builds implements `EngineModel`. The engine calls
`forward_batch` for every eager step and every decode-graph capture, reads the declared
capabilities (`uses_mrope`, `is_hybrid`) instead of probing attributes, and asks
`as_piecewise()` for the few members the piecewise prefill graphs need (`PiecewiseModel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ...inputs.multimodal import MultimodalParams
    from ..attention_backend.interface import AttentionMetadata
    from ..input_batch import InputBatch


@dataclass
class StackInputs:
    """What the text decoder stack takes for one step (`PiecewiseModel.stack_inputs`)."""

    inputs_embeds: torch.Tensor  # [T, hidden], media embeddings merged in
    position_ids: torch.Tensor  # [3, 1, T], generation deltas applied
    cos_sin: torch.Tensor  # [T, rotary_dim]
    deepstack_embeds: list[torch.Tensor] | None  # Qwen3-VL: per-level [T, hidden], image steps


@dataclass(frozen=True)
class PiecewiseStack:
    """The text decoder stack as the piecewise graphs capture it, with the sizes of its
    static inputs (the mixers' outputs are shaped like their inputs, `run_split`)."""

    # (None, inputs_embeds=[T, hidden], cos_sin=[T, width], deepstack_embeds=list | None)
    # -> final-normed hidden [T, hidden]; every token mixer (attention, DeltaNet) goes through
    # `attention_backend.piecewise.run_split`, and nothing else reads the metadata.
    stack: Callable[..., torch.Tensor]
    num_layers: int  # mixer calls per forward (one per layer)
    hidden_size: int
    dtype: torch.dtype  # of the embeddings
    cos_sin_width: int  # columns of one row of the rotary table
    cos_sin_dtype: torch.dtype
    deepstack_levels: int  # Qwen3-VL's deepstack inputs per step (0: none)


class PiecewiseModel(Protocol):
    """A model whose prefill/mixed steps can run as piecewise CUDA graphs."""

    def piecewise_stack(self) -> PiecewiseStack: ...

    def stack_inputs(
        self,
        attn_metadata: AttentionMetadata,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        multimodal_params: Sequence[MultimodalParams] = (),
    ) -> StackInputs: ...

    def compute_logits(
        self, hidden_states: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor: ...


class EngineModel(Protocol):
    """The executor's view of a model (`PyTorchModelEngine`, the graph runners)."""

    @property
    def uses_mrope(self) -> bool:
        """Takes `[3, 1, T]` positions and keeps a per-slot mRoPE delta (Qwen-VL models)."""
        ...

    @property
    def is_hybrid(self) -> bool:
        """Keeps per-slot recurrent state besides the KV cache (Qwen3.5/3.6)."""
        ...

    @property
    def has_vision(self) -> bool:
        """Has a vision tower (a `language_model_only` VL checkpoint has none)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def multimodal_data_device_paths(self) -> list[str]:
        """Tensors of a request's `multimodal_data` moved to the device before its first
        chunk (mRoPE keys always among them); empty for text LLMs."""
        ...

    def forward_batch(self, batch: InputBatch) -> torch.Tensor:
        """Logits `[num_seqs, vocab]` of each request's last token (context requests first),
        or `[T, vocab]` with `batch.return_context_logits`."""
        ...

    def forward_hidden(self, batch: InputBatch) -> torch.Tensor:
        """The eager step up to the final norm: hidden states of every token `[T, hidden]`
        (steps with prompt logprobs; `lm_logits` then runs the LM head over chosen rows)."""
        ...

    def lm_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head: `[n, hidden]` -> `[n, vocab]`."""
        ...

    def per_slot_state(self) -> dict[str, torch.Tensor]:
        """Device tensors with one row per seq slot plus the dummy slot (`seq_slots.py`): the
        mRoPE delta cache, the recurrent conv/SSM rows. `SlotState` checks their size."""
        ...

    def why_not_piecewise(self) -> str:
        """Why prefill/mixed steps cannot run as piecewise graphs ("" when they can)."""
        ...

    def as_piecewise(self) -> PiecewiseModel | None:
        """This model as a `PiecewiseModel` when `why_not_piecewise()` is "", else None."""
        ...
