"""CUDA graphs of the MTP head's draft passes after a verify-graph step (verify_graphs.py).

After a verify step of B requests with `L = 1 + k` rows each, the eager drafter
(mtp_drafter.py) runs pass 1 over each request's accepted positions (1..L of them) and then
k - 1 one-token passes, as prefill chunks: a few hundred launches of one MTP layer and the LM
head, host-bound at small batch. Here every pass has one shape per bucket of requests:

- pass 1 runs all L positions of every request as decode rows (`past + t`, the verify rows'
  KV positions), feeding row t the token that followed it: the accepted run, then the run's
  last token again past it. Rows past a request's accepted part compute nothing anyone reads:
  each row attends to positions up to its own, and the KV they write past the accepted part
  (`past + e ..`) is overwritten by the next passes before any of them reads it, as the eager
  drafts' KV is. Each request's draft 1 comes from its row `e - 1`, picked on the device.
- pass j > 1: one decode row a request at the accepted part's last position + j - 1.
Per step the host writes the positions' KV slots, lengths and the picked rows into static
buffers; the graph reads them. Requests that finished this step (no drafts wanted) and
padded requests write no KV (slot -1) and their drafts are ignored.

Only a step whose every request verified all k drafts has this layout; a step of fewer
drafts each (the budget left near `max_tokens`) drafts eagerly. On by default with the verify
graphs; `TRTLLM_MTP_DRAFT_GRAPHS=0` turns them off (setup.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from ...._utils import maybe_pin_memory
from ...attention_backend.interface import AttentionMetadata
from ..cuda_graph_runner import capture_graph, graph_rows_metadata, pick_bucket

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from ..batch_builder import InputBatchBuilder
    from ..llm_request import LlmRequest
    from .mtp_drafter import MTPDrafter

logger = logging.getLogger(__name__)


@dataclass
class DraftRequest:
    """One verify request's part of the passes: its verify rows' first KV position, the
    tokens it emitted this step and whether it wants drafts (False: no KV written)."""

    request: LlmRequest
    start: int
    emitted: list[int]
    drafting: bool


class DraftGraphRunner:
    """Graphs of the k draft passes after a verify step of `L = k + 1` rows a request."""

    def __init__(
        self,
        drafter: MTPDrafter,
        batch_sizes: list[int],
        num_drafts: int,
        hidden_size: int,
        max_blocks_per_seq: int,
        use_mrope: bool,
    ) -> None:
        if num_drafts < 1:
            raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
        self.drafter = drafter
        self.batch_sizes = sorted(set(batch_sizes))
        self.k = num_drafts
        self.rows = num_drafts + 1
        dev = drafter.device
        b, L = self.batch_sizes[-1], self.rows
        dtype = drafter.lm.model.embed_tokens.weight.dtype  # the stack's hidden states'
        self.hidden = torch.zeros(b * L, hidden_size, dtype=dtype, device=dev)
        self.positions = torch.zeros(
            (3, 1, b * L) if use_mrope else (1, b * L), dtype=torch.int32, device=dev
        )
        self.next_ids = torch.zeros(b * L, dtype=torch.int64, device=dev)
        self.last = torch.zeros(b, dtype=torch.int64, device=dev)
        # Pass 1's rows, then each later pass's: KV length before the row and KV slot.
        self.cached = torch.zeros(self.k, b * L, dtype=torch.int32, device=dev)
        self.slots = torch.full((self.k, b * L), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(b * L, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._ones = torch.ones(b * L, dtype=torch.int32, device=dev)
        self._cu = torch.arange(b * L + 1, dtype=torch.int32, device=dev)
        self._zeros = torch.zeros(b * L, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._constants: dict[int, list[torch.Tensor]] = {}
        self.pool: _POOL_HANDLE | None = None

    def bucket(self, num_requests: int) -> int | None:
        return pick_bucket(self.batch_sizes, num_requests, True)

    def takes(self, num_requests: int, tokens_per_request: int) -> bool:
        """Whether the passes after a step of `num_requests` verify rows of
        `tokens_per_request` tokens each replay a graph here: every request verified all k
        drafts (fewer, near `max_tokens`, leaves other shapes to the eager passes)."""
        return tokens_per_request == self.rows and self.bucket(num_requests) is not None

    # ------------------------------------------------------------------ the passes
    def _metadata(self, num_rows: int, p: int, table_rows: torch.Tensor) -> AttentionMetadata:
        """Pass `p`'s `num_rows` decode rows over the static buffers."""
        return graph_rows_metadata(
            num_rows,
            seq_lens=self._ones[:num_rows],
            num_cached_tokens=self.cached[p, :num_rows],
            cu_seqlens_q=self._cu[: num_rows + 1],
            block_tables=table_rows,
            slot_mapping=self.slots[p, :num_rows],
            seq_slots=self._zeros[:num_rows],
            seq_slots_cpu=torch.zeros(num_rows, dtype=torch.long),
            kv_cache_manager=self.drafter.kv_cache_manager,
            tokens_per_block=self.drafter.tokens_per_block,
        )

    def _passes(self, bucket: int) -> torch.Tensor:
        """Every pass of `bucket` requests over the static buffers -> drafts `[bucket, k]`."""
        d, L = self.drafter, self.rows
        n = bucket * L
        embed = d.lm.model.embed_tokens
        md = self._metadata(n, 0, self.tables[:n])
        positions = self.positions[..., :n]
        state, token = d._step(
            md, embed(self.next_ids[:n]), self.hidden[:n], positions, 0, self.last[:bucket], None
        )
        pos = positions.index_select(-1, self.last[:bucket])
        drafts = [token]
        table = self.tables[:n:L]  # each request's first row: its block table
        rows = torch.arange(bucket, device=state.device)
        for step in range(1, self.k):
            pos = pos + 1
            md = self._metadata(bucket, step, table)
            state, token = d._step(md, embed(token), state, pos, step, rows, None)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    # ------------------------------------------------------------------ per step
    def fill(
        self,
        requests: Sequence[DraftRequest],
        hidden: torch.Tensor,
        positions: torch.Tensor,
        block_table: np.ndarray,
    ) -> int:
        """Write a step's inputs into the static buffers; returns the bucket. `hidden` and
        `positions` are the verify step's (`L` rows a request, deltas applied),
        `block_table` its requests' blocks (-1 past each row's)."""
        b, L, k = len(requests), self.rows, self.k
        bucket = self.bucket(b)
        if bucket is None:
            raise ValueError(f"no draft graph holds {b} requests (sizes {self.batch_sizes})")
        n, tpb = b * L, self.drafter.tokens_per_block
        self.hidden[:n].copy_(hidden[:n])
        self.positions[..., :n].copy_(positions[..., :n])
        starts = np.asarray([r.start for r in requests], dtype=np.int64)
        drafting = np.asarray([r.drafting for r in requests], dtype=bool)
        # A request that stopped this step may have emitted nothing; it writes no KV.
        runs = [r.emitted or [0] for r in requests]
        emitted = np.asarray([len(run) for run in runs], dtype=np.int64)
        if emitted.max() > L:
            raise ValueError(f"each request emits at most {L} tokens, got {emitted.tolist()}")
        ids = np.asarray(
            [[*run, *[run[-1]] * (L - len(run))] for run in runs], dtype=np.int64
        ).reshape(-1)
        held = (block_table >= 0).sum(axis=1)
        # Pass p's KV position of each row: pass 1 all L verify positions, later passes one.
        pos1 = (starts[:, None] + np.arange(L)[None, :]).reshape(-1)
        ends = starts + emitted - 1
        later = ends[None, :] + np.arange(1, k)[:, None]  # [k - 1, b]
        cached = np.zeros((k, bucket * L), dtype=np.int32)
        slots = np.full((k, bucket * L), -1, dtype=np.int64)
        cached[0, :n] = pos1
        slots[0, :n] = _kv_slots(pos1, np.repeat(np.arange(b), L), block_table, held, tpb)
        slots[0, :n][~np.repeat(drafting, L)] = -1
        for p in range(1, k):
            cached[p, :b] = later[p - 1]
            kv = _kv_slots(later[p - 1], np.arange(b), block_table, held, tpb)
            slots[p, :b] = np.where(drafting, kv, -1)
        table = np.zeros((bucket * L, self.tables.shape[1]), dtype=np.int32)
        table[:n, : block_table.shape[1]] = np.repeat(np.maximum(block_table, 0), L, axis=0)
        last = np.arange(bucket, dtype=np.int64) * L
        last[:b] += emitted - 1
        self.next_ids[:n].copy_(maybe_pin_memory(torch.from_numpy(ids)), non_blocking=True)
        self.next_ids[n : bucket * L].zero_()
        self.hidden[n : bucket * L].zero_()
        self.positions[..., n : bucket * L].zero_()
        for dst, src in (
            (self.cached[:, : bucket * L], cached),
            (self.slots[:, : bucket * L], slots),
            (self.tables[: bucket * L], table),
            (self.last[:bucket], last),
        ):
            dst.copy_(maybe_pin_memory(torch.from_numpy(src)), non_blocking=True)
        return bucket

    def draft(
        self,
        requests: Sequence[DraftRequest],
        hidden: torch.Tensor,
        positions: torch.Tensor,
        builder: InputBatchBuilder,
    ) -> list[list[int]]:
        """The k drafts of each of a verify step's requests (in its order; meaningless for
        the ones not drafting) from its `hidden` states and `positions`."""
        live = [i for i, r in enumerate(requests) if r.drafting]
        table = np.zeros((len(requests), 1), dtype=np.int32)
        if live:
            held = builder.block_table([requests[i].request for i in live])
            table = np.full((len(requests), held.shape[1]), -1, dtype=np.int32)
            table[live] = held
        bucket = self.fill(requests, hidden, positions, table)
        return self.run(bucket)[: len(requests)].tolist()  # the one copy of all

    def run(self, bucket: int) -> torch.Tensor:
        """The drafts `[bucket, k]` of the filled step (graph memory: read before the next)."""
        self.graphs[bucket].replay()
        return self.outputs[bucket]

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self, bucket: int) -> None:
        """Capture `bucket`'s passes over padded inputs (every KV write off)."""
        n = bucket * self.rows
        self.slots[:, :n].fill_(-1)
        self.cached[:, :n].zero_()
        self.tables[:n].zero_()
        self.last[:bucket].copy_(torch.arange(bucket, device=self.last.device) * self.rows)
        graph, out, self._constants[bucket] = capture_graph(lambda: self._passes(bucket), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bucket] = graph
        self.outputs[bucket] = out

    def capture_all(self) -> None:
        buckets = sorted(self.batch_sizes, reverse=True)
        for bucket in tqdm(buckets, desc="Capturing MTP draft CUDA graphs", leave=False):
            self.capture(bucket)
        logger.info("captured MTP draft CUDA graphs for batch sizes %s", self.batch_sizes)


def _kv_slots(
    pos: np.ndarray, row: np.ndarray, table: np.ndarray, held: np.ndarray, tpb: int
) -> np.ndarray:
    """The KV slot of position `pos[i]` of request `row[i]`; -1 past its claimed blocks."""
    blk = pos // tpb
    inside = blk < held[row]
    out = np.full(pos.shape[0], -1, dtype=np.int64)
    out[inside] = table[row[inside], blk[inside]].astype(np.int64) * tpb + pos[inside] % tpb
    return out
