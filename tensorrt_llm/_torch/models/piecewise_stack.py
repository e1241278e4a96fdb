"""What a model hands the piecewise prefill/mixed graphs (`pyexecutor/piecewise_graph_runner.py`).

A text decoder stack qualifies when each layer calls exactly one token mixer through
`run_split` (attention; the Gated DeltaNet of hybrid stacks) and everything else in it is
row-wise over the step's tokens (norms, projections, rope, a dense or MoE MLP): the stack says
so itself (`piecewise_blocker`). The model class opts in with `register_auto_model(...,
supports_piecewise=True)`, the per-model switch kept off where the graphs were measured not to
pay. `TextPiecewiseMixin` gives the text-only causal LMs the `PiecewiseModel` members; the VL
models have their own `stack_inputs` (vision tower, mRoPE) and share `piecewise_stack_of`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from .engine_model import PiecewiseStack, StackInputs

if TYPE_CHECKING:
    from ...inputs.multimodal import MultimodalParams
    from ..attention_backend.interface import AttentionMetadata
    from .engine_model import PiecewiseModel
    from .modeling_qwen2 import DecoderStack


def not_registered(cls: type) -> str:
    return f"{cls.__name__} is not registered with supports_piecewise=True"


def piecewise_stack_of(stack: DecoderStack, deepstack_levels: int = 0) -> PiecewiseStack:
    """The stack and the sizes of the runner's static inputs (the stack qualifies)."""
    reason = stack.piecewise_blocker()
    if reason:
        raise ValueError(f"piecewise graphs: {reason}")
    embed = stack.embed_tokens.weight
    # One row of the model's own table gives the cos/sin width and dtype ([T] positions are
    # valid for RoPE and mRoPE alike).
    row = stack.rotary_emb.get_cos_sin(torch.zeros(1, dtype=torch.int32, device=embed.device))
    return PiecewiseStack(
        stack=stack,
        num_layers=len(stack.layers),
        hidden_size=embed.shape[1],
        dtype=embed.dtype,
        cos_sin_width=row.shape[-1],
        cos_sin_dtype=row.dtype,
        deepstack_levels=deepstack_levels,
    )


class TextPiecewiseMixin:
    """`PiecewiseModel` for a text-only causal LM (`Qwen2TextForCausalLM` and subclasses):
    the stack's inputs are the token embeddings and the rotary rows of the step's positions."""

    # Set by `register_auto_model(..., supports_piecewise=)` on each registered class.
    supports_piecewise: ClassVar[bool] = False
    model: DecoderStack

    def why_not_piecewise(self) -> str:
        reason = self.model.piecewise_blocker()
        if reason:
            return reason
        return "" if self.supports_piecewise else not_registered(type(self))

    def as_piecewise(self) -> PiecewiseModel | None:
        return None if self.why_not_piecewise() else self  # type: ignore[return-value]

    def piecewise_stack(self) -> PiecewiseStack:
        reason = self.why_not_piecewise()
        if reason:
            raise ValueError(f"piecewise graphs: {reason}")
        return piecewise_stack_of(self.model)

    def stack_inputs(
        self,
        attn_metadata: AttentionMetadata,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        multimodal_params: Sequence[MultimodalParams] = (),
    ) -> StackInputs:
        """Everything before the decoder stack: token embeddings and cos/sin rows."""
        embeds = self.model.embed_tokens(input_ids.reshape(-1))
        cos_sin = self.model.get_cos_sin(position_ids)
        return StackInputs(embeds, position_ids, cos_sin, None)
