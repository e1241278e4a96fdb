"""CUDA graphs for pure-generation steps, one graph per batch-size bucket.

A graph captures the model's `forward_batch` over views of the engine's persistent
`InputBuffers`. At replay the step's `InputBatch` has written the real rows of those buffers
(`InputBatchBuilder.build`); this runner fills the padded rows so they write nothing (slot -1)
and read the dummy slot, then replays. mRoPE positions of
generation rows are `past_len + delta`, and the delta is read from the seq-slot cache INSIDE the
graph, so a replay always sees the live cache: slots written by context steps (eager) are current.

NOTE: graphs are gated only on "pure generation step that fits a bucket", never on whether requests
carry mRoPE deltas (gating on that cost upstream 59% of text-only decode throughput).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
from tqdm import tqdm

from ..._utils import keeping_constants
from ..attention_backend.interface import AttentionMetadata
from ..input_batch import InputBatch

if TYPE_CHECKING:
    # torch's own name for a graph memory pool handle (torch/cuda/graphs.py imports it so too).
    from torch.cuda import _POOL_HANDLE

    from .engine_config import CudaGraphConfig
    from .model_engine import PyTorchModelEngine
    from .resource_manager import KVCacheManager

logger = logging.getLogger(__name__)

T = TypeVar("T")  # what a captured call returns (its outputs live in the graph's memory)

# Up to the default batch cap on CUDA (capacity.py); past 256 in steps of 64 so a batch
# never pads to more than 25% extra rows.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def graph_batch_sizes(config: CudaGraphConfig, max_batch_size: int) -> list[int]:
    """The batch sizes to capture: the config's list, else the defaults up to its cap (kept)."""
    if config.batch_sizes is not None:
        return sorted(set(config.batch_sizes))
    cap = config.largest(max_batch_size)
    return sorted({b for b in DEFAULT_BATCH_SIZES if b <= cap} | {cap})


def pick_bucket(batch_sizes: list[int], batch_size: int, enable_padding: bool) -> int | None:
    """The captured size a batch replays in: the smallest that holds it (padding), or only an
    exact match without padding; None runs the step eagerly."""
    if not enable_padding:
        return batch_size if batch_size in batch_sizes else None
    i = bisect.bisect_left(batch_sizes, batch_size)
    return batch_sizes[i] if i < len(batch_sizes) else None


def capture_graph(
    call: Callable[[], T], pool: _POOL_HANDLE | None
) -> tuple[torch.cuda.CUDAGraph, T, list[torch.Tensor]]:
    """`call` captured in a CUDA graph (memory from `pool`, a new pool when None) after two
    eager runs on a side stream (allocator and autotuners warmed outside the graph): the
    graph, its output, and the cached device constants its kernels read, which must live as
    long as it does (`_utils.keeping_constants`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with keeping_constants() as constants, torch.cuda.graph(graph, pool=pool):
        out = call()
    return graph, out, constants


def graph_rows_metadata(
    num_rows: int,
    *,
    seq_lens: torch.Tensor,
    num_cached_tokens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_slots: torch.Tensor,
    seq_slots_cpu: torch.Tensor,
    kv_cache_manager: KVCacheManager | None,
    tokens_per_block: int,
    tokens_per_generation: int = 1,
) -> AttentionMetadata:
    """Metadata of `num_rows` generation rows of one token over a graph's static device
    buffers (views), as a capture records them."""
    ones = torch.ones(num_rows, dtype=torch.int32)
    return AttentionMetadata(
        num_contexts=0,
        num_generations=num_rows,
        num_ctx_tokens=0,
        num_tokens=num_rows,
        seq_lens_cpu=ones,
        # Host view for layers that branch on it (recurrent state: "has a past"). Every
        # generation row has a past; the device tensors hold the real lengths at replay.
        num_cached_tokens_cpu=ones.clone(),
        seq_lens=seq_lens,
        num_cached_tokens=num_cached_tokens,
        cu_seqlens_q=cu_seqlens_q,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        seq_slots=seq_slots,
        seq_slots_cpu=seq_slots_cpu,
        kv_cache_manager=kv_cache_manager,
        tokens_per_block=tokens_per_block,
        tokens_per_generation=tokens_per_generation,
    )


class CUDAGraphRunner:
    """Owns every captured graph, its output tensor and the shared memory pool.

    It takes the engine's fixed parts at construction (model, buffers, sizes, KV cache, the
    dummy slot) and, per step, only the `InputBatch`. Buckets count requests; a request is
    `rows_per_request` generation rows (1 here; MTP verify steps: spec_decode/verify_graphs.py).
    """

    rows_per_request = 1
    kind = "decode"  # what the progress bar and the log line call the graphs

    def __init__(
        self, engine: PyTorchModelEngine, batch_sizes: list[int], enable_padding: bool = True
    ) -> None:
        self.model = engine.model
        self.buffers = engine.buffers
        self.kv_cache_manager = engine.kv_cache_manager
        self.tokens_per_block = engine.tokens_per_block
        if self.kv_cache_manager is None:
            raise ValueError("decode CUDA graphs need the engine's KV cache manager first")
        bad = [b for b in batch_sizes if b < 1 or b > engine.max_batch_size]
        if not batch_sizes or bad:
            raise ValueError(f"cuda graph batch sizes {bad} outside [1, max_batch_size]")
        self.batch_sizes = sorted(set(batch_sizes))
        self.enable_padding = enable_padding
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._constants: dict[int, list[torch.Tensor]] = {}
        self.pool: _POOL_HANDLE | None = None  # the first captured graph's, shared by all
        # The last seq-slot-cache entry is the dummy slot: padded rows read delta 0 from it.
        self.dummy_slot = engine.slot_state.dummy_slot
        cu = engine.buffers.cu_seqlens_q
        # 1..max_batch_size, built once: padded rows' cu_seqlens offsets without a per-step alloc.
        self._pad_offsets = torch.arange(
            1, engine.max_generation_rows + 1, dtype=cu.dtype, device=cu.device
        )

    def bucket(self, batch_size: int) -> int | None:
        return pick_bucket(self.batch_sizes, batch_size, self.enable_padding)

    def can_run(self, batch: InputBatch) -> bool:
        md = batch.attn_metadata
        return (
            md.num_contexts == 0
            and md.num_generations > 0
            and md.tokens_per_generation == self.rows_per_request
            and not batch.return_context_logits
            and self.bucket(md.num_generations // self.rows_per_request) is not None
        )

    # ------------------------------------------------------------------ padding
    def _pad(self, real: int, bucket: int) -> None:
        """Make rows [real, bucket) harmless: no KV write, dummy slot, one token at block 0
        (row counts, `rows_per_request` a request)."""
        buf = self.buffers
        if real == bucket:
            return
        buf.input_ids[real:bucket].zero_()
        buf.position_ids[..., real:bucket].zero_()
        buf.slot_mapping[real:bucket].fill_(-1)
        buf.seq_lens[real:bucket].fill_(1)
        buf.num_cached_tokens[real:bucket].zero_()
        buf.seq_slots[real:bucket].fill_(self.dummy_slot)
        buf.block_tables[real:bucket].zero_()
        steps = self._pad_offsets[: bucket - real]
        buf.cu_seqlens_q[real + 1 : bucket + 1].copy_(buf.cu_seqlens_q[real] + steps)

    def _save_rows(self, real: int) -> dict[str, torch.Tensor]:
        """Copies of the step's rows of every input buffer (positions: the last axis)."""
        saved = {}
        for name, tensor in vars(self.buffers).items():
            rows = tensor[..., : real + 1] if name == "position_ids" else tensor[: real + 1]
            saved[name] = rows.clone()
        return saved

    def _restore_rows(self, saved: dict[str, torch.Tensor], real: int) -> None:
        for name, rows in saved.items():
            tensor = getattr(self.buffers, name)
            target = tensor[..., : real + 1] if name == "position_ids" else tensor[: real + 1]
            target.copy_(rows)

    def _metadata(self, bucket: int) -> AttentionMetadata:
        """The capture's metadata for `bucket` generation rows."""
        buf = self.buffers
        return graph_rows_metadata(
            bucket,
            seq_lens=buf.seq_lens[:bucket],
            num_cached_tokens=buf.num_cached_tokens[:bucket],
            cu_seqlens_q=buf.cu_seqlens_q[: bucket + 1],
            block_tables=buf.block_tables[:bucket],
            slot_mapping=buf.slot_mapping[:bucket],
            seq_slots=buf.seq_slots[:bucket],
            seq_slots_cpu=torch.full((bucket,), self.dummy_slot, dtype=torch.long),
            kv_cache_manager=self.kv_cache_manager,
            tokens_per_block=self.tokens_per_block,
            tokens_per_generation=self.rows_per_request,
        )

    def _model_call(self, bucket: int) -> torch.Tensor:
        """The captured call over `bucket` requests' rows."""
        rows = bucket * self.rows_per_request
        buf = self.buffers
        batch = InputBatch(
            attn_metadata=self._metadata(rows),
            input_ids=buf.input_ids[:rows],
            position_ids=buf.position_ids[..., :rows],
        )
        return self._forward(batch, bucket)

    def _forward(self, batch: InputBatch, bucket: int) -> torch.Tensor:
        return self.model.forward_batch(batch)

    # ------------------------------------------------------------------ capture / replay
    @torch.inference_mode()
    def capture(self, bucket: int) -> None:
        buf = self.buffers
        buf.cu_seqlens_q[0].zero_()
        self._pad(0, bucket * self.rows_per_request)
        graph, out, self._constants[bucket] = capture_graph(
            lambda: self._model_call(bucket), self.pool
        )
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bucket] = graph
        self.outputs[bucket] = out

    def capture_all(self) -> None:
        # Largest first, so smaller graphs reuse the pool memory of the largest one.
        buckets = sorted(self.batch_sizes, reverse=True)
        for bucket in tqdm(buckets, desc=f"Capturing {self.kind} CUDA graphs", leave=False):
            self.capture(bucket)
        logger.info("captured %s CUDA graphs for batch sizes %s", self.kind, self.batch_sizes)

    @torch.inference_mode()
    def run(self, batch: InputBatch) -> torch.Tensor:
        """Replay the bucket of a pure-generation `batch` whose rows are already written."""
        real = batch.attn_metadata.num_generations
        per_request = self.rows_per_request
        bucket = self.bucket(real // per_request)
        assert bucket is not None
        if bucket not in self.graphs:
            # NOTE: capture pads rows [0, bucket) of the shared buffers: save the step's rows.
            saved = self._save_rows(real)
            self.capture(bucket)
            self._restore_rows(saved, real)
        self._pad(real, bucket * per_request)
        self.graphs[bucket].replay()
        # NOTE: the output lives in graph memory that the next replay overwrites; slice now and
        # let the sampler consume it before the next step.
        return self.outputs[bucket][:real]
