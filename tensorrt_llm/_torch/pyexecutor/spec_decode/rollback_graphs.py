"""CUDA graphs of the MTP rollback after a verify-graph step (verify_graphs.py).

A request that rejected drafts runs the recurrence of its accepted tokens again from the
state saved before the step (rollback.py, `gated_delta_net_rows.replay_rows`): two kernel
launches a DeltaNet layer, ~100 for Qwen3.6-27B, each behind a few dozen microseconds of
Python. On an H100 that was 6-9 ms of a 35 ms rejected-draft step for well under a
millisecond of GPU work (benchmarks/results/qwen3_6_27b_h200.md). In a verify-graph bucket
whose records are graph memory (`VerifyGraphRunner.recorded`) every input of that replay
sits at a fixed address but two, which this runner makes static too:

- the saved rows: every speculative step saves its rows into the rollback's held copies
  (`RecurrentRollback.saved_rows`, a full batch: the memory the snapshot has reserved out of
  the KV cache, setup.snapshot_reserve_bytes), `snapshot` here;
- the index vectors (`gated_delta_net_rows.ReplayIndex`): every request of the bucket is a
  row of the replay, in the verify step's order (its saved row and its recorded tokens are
  its index times `1 + k`); a request that keeps its state (every draft accepted, finished,
  or padding) replays one token onto the dummy slot, which nothing reads.

So the replay of a recorded bucket is one graph, filled by one host-to-device copy a step.
On by default (setup.py; `TRTLLM_MTP_ROLLBACK_GRAPHS=0` rolls back eagerly).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from ...._utils import maybe_pin_memory
from ...modules.gated_delta_net_rows import ReplayIndex, replay_layers
from ..cuda_graph_runner import capture_graph

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from .rollback import RecurrentRollback
    from .verify_graphs import VerifyGraphRunner

logger = logging.getLogger(__name__)


class RollbackGraphRunner:
    """The rollback of a verify-graph step as one CUDA graph per bucket of requests."""

    def __init__(
        self,
        rollback: RecurrentRollback,
        verify: VerifyGraphRunner,
        num_rows: int,
    ) -> None:
        self.rollback = rollback
        self.records = verify.records
        self.rows = verify.rows_per_request
        self.dummy_slot = verify.dummy_slot
        if rollback.saved_rows is None:
            raise ValueError("the rollback graphs read the rollback's held saved rows")
        self.snapshot = rollback.saved_rows
        num_rows = min(num_rows, self.snapshot[0].shape[0])
        self.batch_sizes = [b for b in sorted(verify.recorded) if b <= num_rows]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._constants: dict[int, list[torch.Tensor]] = {}
        self.pool: _POOL_HANDLE | None = None
        b, L = max(self.batch_sizes, default=0), self.rows
        pairs = zip(rollback.pools, self.snapshot, strict=True)
        self.saved = {pool.data_ptr(): rows for pool, rows in pairs}
        # The index vectors as views of one buffer (one copy a step), each at an even offset:
        # Triton specializes a pointer argument on its 16-byte alignment.
        sizes = {"tokens": b * L, "slots": b, "saved_rows": b, "starts": b, "keeps": b}
        sizes["cu"] = b + 1
        self._offsets: dict[str, int] = {}
        total = 0
        for name, size in sizes.items():
            self._offsets[name] = total
            total += size + size % 2
        dev = rollback.pools[0].device
        self.index = torch.zeros(total, dtype=torch.int64, device=dev)
        self._host = np.zeros(total, dtype=np.int64)

    def takes(self, bucket: int | None) -> bool:
        """Whether a verify-graph step of `bucket` (the verify runner's) rolls back here."""
        return bucket is not None and bucket in self.graphs

    # ------------------------------------------------------------------ the replay
    def _view(self, name: str, size: int) -> torch.Tensor:
        start = self._offsets[name]
        return self.index[start : start + size]

    def _index(self, bucket: int) -> ReplayIndex:
        """The bucket's replay index over the static buffer (the same views each replay)."""
        b, L = bucket, self.rows
        return ReplayIndex(
            tokens=self._view("tokens", b * L),
            slots=self._view("slots", b),
            saved_rows=self._view("saved_rows", b),
            starts=self._view("starts", b),
            keeps=self._view("keeps", b),
            cu=self._view("cu", b + 1),
        )

    def _replay(self, bucket: int) -> None:
        replay_layers(self.records[bucket], self._index(bucket), self.saved)

    def fill(self, bucket: int, kept: Sequence[tuple[int, int, int]]) -> None:
        """Write the index of a replay of `bucket` requests: each `(request index, tokens
        kept, seq slot)` of `kept` keeps its first tokens; every other request one token on
        the dummy slot."""
        b, L = bucket, self.rows
        keeps = np.ones(b, dtype=np.int64)
        slots = np.full(b, self.dummy_slot, dtype=np.int64)
        for i, keep, slot in kept:
            if not 0 <= i < b or not 0 < keep <= L:
                raise ValueError(f"request {i} keeping {keep} of {L} tokens in a bucket of {b}")
            keeps[i], slots[i] = keep, slot
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(keeps, out=cu[1:])
        starts = np.arange(b, dtype=np.int64) * L
        tokens = np.zeros(b * L, dtype=np.int64)
        tokens[: cu[-1]] = np.repeat(starts - cu[:-1], keeps) + np.arange(cu[-1])
        host = self._host
        for name, values in (
            ("tokens", tokens),
            ("slots", slots),
            ("saved_rows", np.arange(b, dtype=np.int64)),
            ("starts", starts),
            ("keeps", keeps),
            ("cu", cu),
        ):
            start = self._offsets[name]
            host[start : start + values.shape[0]] = values
        self.index.copy_(maybe_pin_memory(torch.from_numpy(host)), non_blocking=True)

    def replay(self, bucket: int, kept: Sequence[tuple[int, int, int]]) -> None:
        """Roll back the `kept` requests (`fill`) of a verify-graph step of `bucket`, from the
        rows `save` copied before it."""
        self.fill(bucket, kept)
        self.run(bucket)

    def run(self, bucket: int) -> None:
        self.graphs[bucket].replay()

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self, bucket: int) -> None:
        """Capture `bucket`'s replay over an index of dummy rows (nothing real is written)."""
        self.fill(bucket, [])
        graph, _, self._constants[bucket] = capture_graph(lambda: self._replay(bucket), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bucket] = graph

    def capture_all(self) -> None:
        for bucket in tqdm(
            self.batch_sizes, desc="Capturing MTP rollback CUDA graphs", leave=False
        ):
            self.capture(bucket)
        logger.info(
            "MTP rollback CUDA graphs for batch sizes %s (saved rows %.0f MiB)",
            self.batch_sizes,
            sum(t.numel() * t.element_size() for t in self.snapshot) / 2**20,
        )
