"""PyTorchModelEngine: owns the model, its input buffers and per-slot state; runs one step.

A step is `build_batch` (scheduled requests -> `InputBatch`, batch_builder.py) then `run`
(the decode CUDA graph, the piecewise prefill graphs, or the eager `forward_batch`). The graph
runners take the `InputBatch` and never call back into the engine; the model is read through
its typed interface (`EngineModel`) only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..input_batch import InputBatch
from .batch_builder import InputBatchBuilder
from .input_buffers import InputBuffers
from .prompt_logprobs import compute_prompt_logprobs
from .request_lifecycle import release_prefilled_media
from .scheduler import ScheduledRequests
from .slot_state import SlotState

if TYPE_CHECKING:
    from ..models.engine_model import EngineModel
    from .cuda_graph_runner import CUDAGraphRunner
    from .piecewise_graph_runner import PiecewiseCUDAGraphRunner
    from .resource_manager import KVCacheManager
    from .spec_decode.verify_graphs import VerifyGraphRunner
    from .tp_step_channel import StepChannel


class PyTorchModelEngine:
    """Owns the model, its input buffers, the per-slot state and the step's execution."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        max_num_tokens: int,
        max_batch_size: int,
        max_seq_len: int,
        tokens_per_block: int,
        tokens_per_generation: int = 1,
    ) -> None:
        # Every registered model class implements `EngineModel` (engine_model.py).
        self.model = cast("EngineModel", model)
        self.device = torch.device(device)
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.tokens_per_block = tokens_per_block
        self.max_blocks_per_seq = -(-max_seq_len // tokens_per_block)
        # MTP verify steps run each request's tokens as that many generation rows
        # (`AttentionMetadata.tokens_per_generation`): the per-row buffers hold them all.
        self.max_generation_rows = max_batch_size * tokens_per_generation
        # NOTE: mRoPE models always take the (3,1,max_num_tokens) int32 position buffer, also
        # for text-only batches, so one code path (and one graph shape) serves every request.
        self.use_mrope = self.model.uses_mrope
        # NOTE: no image/video token ids here: vision rows come from each request's placeholder
        # spans; comparing step tokens with pad ids broke steps where a decode row sampled one.
        self.vocab_size: int = self.model.vocab_size
        self.kv_cache_manager: KVCacheManager | None = None
        self.cuda_graph_runner: CUDAGraphRunner | None = None  # set by create_py_executor
        # Prefill/mixed steps (`cuda_graph_config.piecewise_max_tokens`).
        self.piecewise_graph_runner: PiecewiseCUDAGraphRunner | None = None
        # MTP verify steps of generation rows alone (spec_decode/verify_graphs.py).
        self.verify_graph_runner: VerifyGraphRunner | None = None
        # Tensor parallelism, rank 0: each step (and KV cache) is sent to the worker ranks
        # before it runs (`tp_step_channel.py`). None on one GPU: no work per step.
        self.step_channel: StepChannel | None = None
        self.buffers = InputBuffers.allocate(
            max_num_tokens,
            self.max_generation_rows,
            self.max_blocks_per_seq,
            self.use_mrope,
            self.device,
        )
        self.slot_state = SlotState(max_batch_size, self.device, self.model)
        self.batch_builder = InputBatchBuilder(
            self.buffers,
            self.slot_state,
            self.device,
            use_mrope=self.use_mrope,
            device_paths=list(self.model.multimodal_data_device_paths),
            max_num_tokens=max_num_tokens,
            max_batch_size=max_batch_size,
            tokens_per_block=tokens_per_block,
            max_blocks_per_seq=self.max_blocks_per_seq,
        )

    def set_kv_cache_manager(self, kv_cache_manager: KVCacheManager | None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.batch_builder.kv_cache_manager = kv_cache_manager
        if self.step_channel is not None:
            self.step_channel.send_kv_cache(kv_cache_manager)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def build_batch(
        self, scheduled: ScheduledRequests, return_context_logits: bool = False
    ) -> InputBatch:
        return self.batch_builder.build(scheduled, return_context_logits)

    @torch.inference_mode()
    def run(self, batch: InputBatch) -> torch.Tensor:
        """Logits of each request's last token: [num_seqs, vocab], context requests first
        (or of every token with `batch.return_context_logits`)."""
        if self.step_channel is not None:
            self.step_channel.send_step(batch)
        runner = self.cuda_graph_runner
        if runner is not None and runner.can_run(batch):
            return runner.run(batch)
        piecewise = self.piecewise_graph_runner
        if piecewise is not None and piecewise.can_run(batch):
            return piecewise.run(batch)
        return self.model.forward_batch(batch)

    @torch.inference_mode()
    def run_step(self, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run`, plus the packed prompt logprobs (device int64, `prompt_logprobs.py`) when a
        request of the step asks for them (None otherwise: exactly `run`).

        Such a step keeps the stack's hidden states of every token: the piecewise graphs give
        them (their LM head runs eagerly anyway), else the eager path does. The decode graph
        never sees such a step (it has context rows). The last-token logits come from the same
        hidden states, so they equal `run`'s."""
        plan = batch.prompt_logprobs
        if plan is None or batch.return_context_logits:
            return self.run(batch), None
        if self.step_channel is not None:
            self.step_channel.send_step(batch)  # with the plan's rows: the workers run them too
        hidden = self.run_hidden(batch)
        md = batch.attn_metadata
        last = md.cu_seqlens_q[1 : md.num_seqs + 1] - 1
        logits = self.model.lm_logits(hidden.index_select(0, last.to(hidden.device)))
        payload = compute_prompt_logprobs(hidden, plan, self.model.lm_logits, self.vocab_size)
        return logits, payload

    @torch.inference_mode()
    def run_hidden(self, batch: InputBatch) -> torch.Tensor:
        """The stack's final-normed hidden states of every token, no LM head and nothing
        sent to tensor-parallel workers (the caller sends what they run): the piecewise
        graphs where the step fits a bucket (a verify step's own graphs first), else eagerly.
        NOTE: from the graphs it is graph memory, valid until their next replay."""
        verify = self.verify_graph_runner
        if verify is not None and verify.can_run(batch):
            return verify.run_hidden(batch)
        piecewise = self.piecewise_graph_runner
        if piecewise is not None and piecewise.can_run(batch):
            return piecewise.run_hidden(batch)
        return self.model.forward_hidden(batch)

    def forward(
        self, scheduled: ScheduledRequests, return_context_logits: bool = False
    ) -> torch.Tensor:
        """`build_batch` then `run` (tests, the capacity probe); media of requests whose
        prefill just ended is released as the executor does."""
        logits = self.run(self.build_batch(scheduled, return_context_logits))
        release_prefilled_media(scheduled)
        return logits
