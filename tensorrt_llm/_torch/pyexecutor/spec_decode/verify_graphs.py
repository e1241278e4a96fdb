"""CUDA graphs of MTP verify steps: the target forward of a step of verify rows alone.

A step whose generation requests each verify k drafts and which has no context chunk is laid
out as `1 + k` generation rows a request (verify_batch.py): one shape per batch size, so a
graph per bucket of requests captures the whole target forward to the stack's final-normed
hidden states (the spec decoder runs the LM head over the rows it checks). Eagerly, the
attention and DeltaNet mixers of such a step ran between the piecewise pieces, ~3000 launches
a step for Qwen3.6-27B (benchmarks/results/qwen3_6_27b_h200.md: the verify forward 23-28 ms on
an H100 against a plain decode step's ~15 ms).

The rollback's records (`gated_delta_net_rows.RowsRecord`: each DeltaNet layer's inputs of the
rows) are graph memory: each recorded bucket keeps the ones its capture made, filled anew at
each replay, and hands them to the step (`run_hidden`). They stay allocated with the graph, so
only the smallest buckets whose records fit `record_budget` bytes together
(`GRAPH_RECORD_BUDGET`, reserved before KV sizing) record; a step of a larger bucket rolls
back with a replay forward, as an eager step too large to record does.
With `recorded_only` (`TRTLLM_MTP_VERIFY_GRAPHS_RECORDED_ONLY=1`, setup.py) the larger buckets
get no graph: their steps run as chunks, which record (until the A/B at c=32 says which pays).

Padded requests are `1 + k` rows each on the dummy slot (`CUDAGraphRunner._pad`); the DeltaNet
rows path runs them from the dummy slot's state, which nothing reads.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ...modules.gated_delta_net_rows import RECORD_MAX_BYTES
from ..cuda_graph_runner import CUDAGraphRunner

if TYPE_CHECKING:
    from ...input_batch import InputBatch
    from ..model_engine import PyTorchModelEngine

logger = logging.getLogger(__name__)

# What the verify graphs' rollback records may hold together (graph memory, for the engine's
# life; kept out of the KV cache: setup.snapshot_reserve_bytes). Qwen3.6-27B's records are
# ~10 MB a request at k = 3, so 1 GiB records the buckets up to 32 requests; a bucket without
# records rolls back with a replay forward (a whole forward again for any rejected draft).
GRAPH_RECORD_BUDGET = 1 << 30


def recorded_buckets(batch_sizes: list[int], bytes_per_request: int, budget: int) -> set[int]:
    """The smallest of `batch_sizes` whose records fit `budget` bytes together, each within
    the bound a step's records have (`RECORD_MAX_BYTES`; none without records)."""
    out: set[int] = set()
    left = budget
    for bucket in sorted(batch_sizes):
        need = bucket * bytes_per_request
        if not bytes_per_request or need > min(left, RECORD_MAX_BYTES):
            break
        out.add(bucket)
        left -= need
    return out


class VerifyGraphRunner(CUDAGraphRunner):
    """Graphs of verify steps of `tokens_per_request` rows a request, per bucket of requests."""

    kind = "MTP verify"

    def __init__(
        self,
        engine: PyTorchModelEngine,
        batch_sizes: list[int],
        tokens_per_request: int,
        enable_padding: bool = True,
        record_bytes_per_token: int = 0,
        record_budget: int = GRAPH_RECORD_BUDGET,
        recorded_only: bool = False,
    ) -> None:
        if tokens_per_request < 2:
            raise ValueError(f"a verify row holds at least 2 tokens, got {tokens_per_request}")
        if max(batch_sizes, default=0) * tokens_per_request > engine.max_generation_rows:
            raise ValueError(
                f"verify graphs of {max(batch_sizes)} requests x {tokens_per_request} tokens "
                f"exceed the engine's {engine.max_generation_rows} generation rows"
            )
        super().__init__(engine, batch_sizes, enable_padding)
        self.rows_per_request = tokens_per_request
        per_request = tokens_per_request * record_bytes_per_token
        self.recorded = recorded_buckets(self.batch_sizes, per_request, record_budget)
        if recorded_only and record_bytes_per_token:
            # A larger bucket rolls back with a replay forward (a whole forward again for any
            # rejected draft); without its graph the step runs as chunks, which record their
            # rows while they fit RECORD_MAX_BYTES and replay the recurrence alone.
            self.batch_sizes = sorted(self.recorded)
        self.records: dict[int, list[Any]] = {}
        self._last_record: list[Any] | None = None

    def takes(self, num_requests: int, tokens_per_request: int) -> bool:
        """Whether a verify step of `num_requests` rows of `tokens_per_request` tokens each
        (`verify_batch.uniform_verify_len`) replays a graph here."""
        return tokens_per_request == self.rows_per_request and bool(self.bucket(num_requests))

    def _forward(self, batch: InputBatch, bucket: int) -> torch.Tensor:
        # A new list per call: after capture it holds the captured call's records only.
        self._last_record = [] if bucket in self.recorded else None
        batch.attn_metadata.recurrent_record = self._last_record
        return self.model.forward_hidden(batch)

    def capture(self, bucket: int) -> None:
        super().capture(bucket)
        if self._last_record is not None:
            self.records[bucket] = self._last_record
        self._last_record = None

    def capture_all(self) -> None:
        super().capture_all()
        logger.info(
            "MTP verify graphs: %d tokens a request; the rollback replays the recurrence alone "
            "in batch sizes %s, a forward in the others",
            self.rows_per_request,
            sorted(self.recorded) or "none",
        )

    def run_hidden(self, batch: InputBatch) -> torch.Tensor:
        """The stack's hidden states of every row of a verify step (`can_run`); the bucket's
        records join `batch.attn_metadata.recurrent_record` when the step asks for them.
        NOTE: graph memory, valid until the next replay."""
        hidden = self.run(batch)
        md = batch.attn_metadata
        if md.recurrent_record is not None:
            bucket = self.bucket(md.num_generations // self.rows_per_request)
            md.recurrent_record.extend(self.records.get(bucket, ()) if bucket else ())
        return hidden
