"""InputBatch: everything one engine step hands to a model, built once per step.

The engine's `InputBatchBuilder` (pyexecutor/batch_builder.py) fills it from the scheduled
requests; the eager path, the decode CUDA graphs and the piecewise graphs all take it, and a model
reads its inputs from it (`EngineModel.forward_batch`). It lives here, below every sub-package,
because models (which may not import the executor) and the executor both name it.

NOTE: the tensors are views into the engine's persistent `InputBuffers`: valid for this step
only, and a CUDA graph replay reads the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..inputs.multimodal import MultimodalParams
    from .attention_backend.interface import AttentionMetadata
    from .pyexecutor.prompt_logprobs import PromptLogprobsPlan


@dataclass
class InputBatch:
    """One step: context requests first, then generation requests (`AttentionMetadata`)."""

    # Batch layout, host sizes, and the device tensors of the attention (seq slots included).
    attn_metadata: AttentionMetadata
    input_ids: torch.Tensor  # [T] int64, device
    # [3, 1, T] int32 (mRoPE models, also for text-only steps) or [1, T] int32; device or, for
    # the CPU reference path, host.
    position_ids: torch.Tensor
    # Context requests of mRoPE models, in row order: mRoPE positions, media, deltas.
    multimodal_params: list[MultimodalParams] = field(default_factory=list)
    # Rows of the logits that give a token this step, in request order: every generation row
    # and each context row whose chunk ends the prompt (host ints).
    sample_rows: list[int] = field(default_factory=list)
    # True: logits of every token `[T, vocab]` (parity tests); never captured in a graph.
    return_context_logits: bool = False
    # The context rows whose prompt logprobs are asked for (None: no request asks; the step
    # computes the LM head over the last tokens only, as always).
    prompt_logprobs: PromptLogprobsPlan | None = None

    @property
    def num_tokens(self) -> int:
        return self.attn_metadata.num_tokens

    @property
    def num_seqs(self) -> int:
        return self.attn_metadata.num_seqs

    @property
    def is_pure_generation(self) -> bool:
        return self.attn_metadata.num_contexts == 0
