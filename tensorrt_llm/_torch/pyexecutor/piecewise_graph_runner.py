"""Piecewise CUDA graphs for steps with context chunks (prefill and mixed), per token bucket.

An eager step of Qwen3-VL-8B costs ~40 ms of host time whatever its size (36 layers x ~20 kernel
launches from Python), against 5-20 ms of GPU work for chunks of 64-1024 tokens
(benchmarks/results/qwen3_vl_8b_h200.md, run 10). Such steps cannot be captured whole: the
prefill attention's grid and host metadata depend on the step's sequences. So the text decoder
stack is captured in pieces over a bucket of padded tokens, cut at every token-mixer call
(`attention_backend/piecewise.py`: attention, and the Gated DeltaNet mixers of hybrid stacks):
piece i runs what lies between mixer calls i-1 and i (norms, projections, rope, MLP or MoE),
and at replay each mixer runs eagerly between the pieces, on the step's real metadata, reading
the pieces' inputs and writing a static output buffer (one per output width and dtype).
What comes before the stack (embeddings, the vision tower, mRoPE bookkeeping) and after it (the
LM head over each request's last token) stays eager.

Padded rows (the bucket past the step's tokens) carry stale but finite values through row-wise
kernels only; the attention gives them zeros and no KV slot, a DeltaNet mixer leaves them as
they were. MoE layers are row-wise too: their Triton grouped GEMM sorts the bucket's (token,
expert) pairs on the device into buffers sized by the bucket, with no host sync, so padded rows
only add routed work. Qwen3-VL's deepstack inputs are static buffers too: media steps copy
theirs in, other steps read zeros. A model says whether its stack qualifies
(`why_not_piecewise`) and hands over its stack and sizes (`PiecewiseModel.piecewise_stack`).

Whether a step runs piecewise is a trade: eager host time is ~35 ms per step, the GPU time of
32 decodes plus a chunk grows ~15 us per chunk token past ~256 (19.7 ms at 1024). Past ~2048
tokens the GPU hides the eager host time and a bucket's padding would only add work, hence
`DEFAULT_PIECEWISE_MAX_TOKENS`, and buckets close enough that padding stays small.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from ..attention_backend.interface import AttentionMetadata
from ..attention_backend.piecewise import split_handler
from ..input_batch import InputBatch

if TYPE_CHECKING:
    from ..models.engine_model import EngineModel, StackInputs
    from .model_engine import PyTorchModelEngine

logger = logging.getLogger(__name__)

# `cuda_graph_config.piecewise_max_tokens=None` (the default) on an eligible model.
DEFAULT_PIECEWISE_MAX_TOKENS = 2048

# Token buckets up to the configured maximum: powers of two while a step is weight-bound, then
# steps of 128/256/1024 tokens so a padded bucket costs at most ~1-2 ms of extra GPU work.
DEFAULT_TOKEN_BUCKETS = (
    (16, 32, 64, 128, 256)
    + tuple(range(384, 1024, 128))
    + tuple(range(1024, 4096, 256))
    + tuple(range(4096, 8193, 1024))
)


def piecewise_token_buckets(max_tokens: int) -> list[int]:
    """The buckets captured for `cuda_graph_config.piecewise_max_tokens=max_tokens`."""
    return sorted({b for b in DEFAULT_TOKEN_BUCKETS if b < max_tokens} | {max_tokens})


def why_not_piecewise(model: EngineModel) -> str:
    """Why `model` cannot run piecewise graphs ("" when it can): the model says."""
    return model.why_not_piecewise()


@dataclass
class _Call:
    """One eager mixer call between two pieces: `out[:n] = op.forward(*inputs, metadata)`."""

    op: Any
    inputs: tuple[torch.Tensor, ...]  # graph memory the piece before wrote
    out: torch.Tensor  # the static buffer the piece after reads, [bucket, width]


@dataclass
class _Pieces:
    graphs: list[torch.cuda.CUDAGraph]
    calls: list[_Call]  # in order; call i runs after graph i
    hidden: torch.Tensor  # the stack's final-normed output, [bucket, hidden]


class PiecewiseCUDAGraphRunner:
    """Captures the pieces of each token bucket (`capture_all` at startup; a bucket missing
    then is captured on its first step) and replays them around the eager mixer calls."""

    def __init__(self, engine: PyTorchModelEngine, token_buckets: list[int]) -> None:
        model = engine.model.as_piecewise()
        if model is None:
            raise ValueError(f"piecewise CUDA graphs: {why_not_piecewise(engine.model)}")
        if (
            not token_buckets
            or min(token_buckets) < 1
            or max(token_buckets) > engine.max_num_tokens
        ):
            raise ValueError(
                f"piecewise token buckets {token_buckets} outside [1, max_num_tokens="
                f"{engine.max_num_tokens}]"
            )
        self.model = model
        spec = model.piecewise_stack()
        self.stack = spec.stack
        self.num_layers = spec.num_layers
        self.buckets = sorted(set(token_buckets))
        largest = self.buckets[-1]
        device = engine.device
        self._largest = largest
        # Static inputs of every piece; the mixers' output buffers, one per (width, dtype),
        # are made by the first warm-up (`_out_buffer`): mixer i writes one, piece i+1 reads
        # it before mixer i+1 writes again.
        self._embeds = torch.zeros(largest, spec.hidden_size, dtype=spec.dtype, device=device)
        self._outs: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._cos_sin = torch.zeros(
            largest, spec.cos_sin_width, dtype=spec.cos_sin_dtype, device=device
        )
        # Deepstack inputs (levels x tokens x hidden); zero except the rows a media step wrote,
        # which the next step without media clears (`_deepstack_rows`).
        levels = spec.deepstack_levels
        self._deepstack = (
            torch.zeros(levels, largest, spec.hidden_size, dtype=spec.dtype, device=device)
            if levels
            else None
        )
        self._deepstack_rows = 0
        self._pieces: dict[int, _Pieces] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def bucket(self, num_tokens: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def can_run(self, batch: InputBatch) -> bool:
        """A step with context requests whose tokens fit a bucket (last-token logits only)."""
        md = batch.attn_metadata
        return (
            md.num_contexts > 0
            and not batch.return_context_logits
            and self.bucket(md.num_tokens) is not None
        )

    # ------------------------------------------------------------------ capture
    def _out_buffer(self, like: torch.Tensor, bucket: int) -> torch.Tensor:
        """The static output of a mixer whose first input is `like` ([bucket, width]).

        NOTE: allocated in the warm-up, outside any graph, so the pool never owns it."""
        key = (like.shape[-1], like.dtype)
        buf = self._outs.get(key)
        if buf is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"mixer output {key} first seen inside a capture")
            buf = torch.zeros(self._largest, key[0], dtype=key[1], device=like.device)
            self._outs[key] = buf
        return buf[:bucket]

    def _stack_call(self, bucket: int) -> torch.Tensor:
        # The metadata only reaches the mixer calls, which the handler takes over.
        deepstack = None if self._deepstack is None else list(self._deepstack[:, :bucket].unbind(0))
        return self.stack(
            None,
            inputs_embeds=self._embeds[:bucket],
            cos_sin=self._cos_sin[:bucket],
            deepstack_embeds=deepstack,
        )

    @torch.inference_mode()
    def capture(self, bucket: int) -> None:
        """Capture the pieces of one bucket (needs no KV cache: no mixer runs)."""
        self._pieces[bucket] = self._capture(bucket)

    def capture_all(self) -> None:
        # Largest first, so the smaller buckets' pieces reuse its pool memory.
        buckets = sorted(self.buckets, reverse=True)
        for bucket in tqdm(buckets, desc="Capturing piecewise prefill CUDA graphs", leave=False):
            self.capture(bucket)
        logger.info("captured piecewise CUDA graphs for token buckets %s", self.buckets)

    def _capture(self, bucket: int) -> _Pieces:
        def skip(op: Any, inputs: tuple[torch.Tensor, ...], md: AttentionMetadata) -> torch.Tensor:
            # warm-up: every kernel but the mixers', at the bucket's shapes
            return self._out_buffer(inputs[0], bucket)

        graphs = [torch.cuda.CUDAGraph()]
        calls: list[_Call] = []

        def cut(op: Any, inputs: tuple[torch.Tensor, ...], md: AttentionMetadata) -> torch.Tensor:
            graphs[-1].capture_end()
            out = self._out_buffer(inputs[0], bucket)
            calls.append(_Call(op, inputs, out))
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self._pool)
            return out

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with split_handler(skip):
                for _ in range(2):  # compiles, autotuning and allocations outside the graphs
                    self._stack_call(bucket)
            torch.cuda.synchronize()
            graphs[0].capture_begin(pool=self._pool)
            try:
                with split_handler(cut):
                    hidden = self._stack_call(bucket)
            finally:
                graphs[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        if len(calls) != self.num_layers:
            raise RuntimeError(
                f"piecewise capture saw {len(calls)} mixer calls for {self.num_layers} layers"
            )
        return _Pieces(graphs, calls, hidden)

    # ------------------------------------------------------------------ replay
    def _stage_deepstack(self, embeds: list[torch.Tensor] | None, num_tokens: int) -> None:
        if embeds is None:
            if self._deepstack_rows:
                assert self._deepstack is not None
                self._deepstack[:, : self._deepstack_rows].zero_()
                self._deepstack_rows = 0
            return
        if self._deepstack is None or len(embeds) != self._deepstack.shape[0]:
            levels = 0 if self._deepstack is None else self._deepstack.shape[0]
            raise ValueError(
                f"step carries {len(embeds)} deepstack inputs, the graphs were captured for "
                f"{levels}"
            )
        for level, src in enumerate(embeds):
            self._deepstack[level, :num_tokens].copy_(src)
        # The rows past num_tokens may hold an earlier step's inputs: zero them on the next
        # step without media, as the padded rows of this one do not matter.
        self._deepstack_rows = max(self._deepstack_rows, num_tokens)

    @torch.inference_mode()
    def run(self, batch: InputBatch) -> torch.Tensor:
        """The step's logits: what comes before the stack (embeddings, vision tower, mRoPE
        bookkeeping) eagerly, the stack as pieces, the LM head eagerly."""
        md = batch.attn_metadata
        inputs = self.model.stack_inputs(
            md, batch.input_ids, batch.position_ids, batch.multimodal_params
        )
        return self.model.compute_logits(self.replay(md, inputs), md)

    @torch.inference_mode()
    def run_hidden(self, batch: InputBatch) -> torch.Tensor:
        """`run` without the LM head: the stack's hidden states of every token (steps with
        prompt logprobs). NOTE: graph memory; consume it before the next replay."""
        md = batch.attn_metadata
        inputs = self.model.stack_inputs(
            md, batch.input_ids, batch.position_ids, batch.multimodal_params
        )
        return self.replay(md, inputs)

    def replay(self, attn_metadata: AttentionMetadata, inputs: StackInputs) -> torch.Tensor:
        """The stack's final-normed hidden states `[num_tokens, hidden]` for this step."""
        num_tokens = attn_metadata.num_tokens
        bucket = self.bucket(num_tokens)
        assert bucket is not None
        self._embeds[:num_tokens].copy_(inputs.inputs_embeds)
        self._cos_sin[:num_tokens].copy_(inputs.cos_sin)
        self._stage_deepstack(inputs.deepstack_embeds, num_tokens)
        pieces = self._pieces.get(bucket)
        if pieces is None:
            self.capture(bucket)
            pieces = self._pieces[bucket]
        for i, graph in enumerate(pieces.graphs):
            graph.replay()
            if i < len(pieces.calls):
                call = pieces.calls[i]
                got = call.op.forward(*call.inputs, attn_metadata)
                # Attention answers every padded row (zeros); a DeltaNet mixer the real ones.
                call.out[: got.shape[0]].copy_(got)
        # NOTE: graph memory the next replay overwrites; the LM head reads it right away.
        return pieces.hidden[:num_tokens]
