"""The InputBatch of a verify step without context chunks: every request's last token and its
drafts as generation rows of one token each (`AttentionMetadata.tokens_per_generation`).

A step of generation requests that all verify the same number of drafts (the common case: the
MTP head drafts k tokens for every greedy or temperature request) has one shape per batch size,
so it can replay a CUDA graph (verify_graphs.py). Laid out as decode rows, each token t of a
request is a row of its own at KV position `past + t`: the attention backends run them as
decode rows (the step's K/V are stored before any row reads, so row t sees the drafts before
it), and the recurrent layers take each request's rows back as one row of `1 + k` tokens
(`qwen3_next_recurrent.gdn_metadata`). The token layout is the chunk batch's (chunk_batch.py):
request i's tokens at rows `i * L .. i * L + L - 1`, so everything after the forward (the LM
head rows, the drafts, the rollback records) is the same.

mRoPE models: a generation row's position is its index plus the request's delta, which the
model reads from the seq-slot cache as for any decode row; no params ride along. The MTP head
gets the positions with the deltas applied (`ChunkBatch.draft_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...._utils import maybe_pin_memory
from ...attention_backend.interface import AttentionMetadata
from ...input_batch import InputBatch
from .chunk_batch import ChunkBatch, ChunkRow, generation_delta

if TYPE_CHECKING:
    from ..batch_builder import InputBatchBuilder


def uniform_verify_len(rows: Sequence[ChunkRow], has_context: bool) -> int:
    """The tokens every row holds when a step can run as generation rows (`build_verify_batch`),
    else 0: no context chunk in the step and every row verifies the same number (>= 1) of
    drafts."""
    if has_context or not rows:
        return 0
    n = len(rows[0].tokens)
    if n < 2 or any(len(r.tokens) != n for r in rows):
        return 0
    return n


def build_verify_batch(builder: InputBatchBuilder, rows: Sequence[ChunkRow]) -> ChunkBatch:
    """Fill `builder`'s persistent buffers with `rows` (each `L >= 2` tokens) as `len(rows) * L`
    generation rows."""
    per_request = uniform_verify_len(rows, False)
    if not per_request:
        raise ValueError("a verify batch needs rows of one length of at least 2 tokens")
    requests = [row.request for row in rows]
    if len(requests) > builder.max_batch_size:
        raise RuntimeError(f"batch of {len(requests)} exceeds max_batch_size")
    num_rows = len(rows) * per_request
    if num_rows > builder.max_num_tokens:
        raise RuntimeError(f"step of {num_rows} tokens exceeds max_num_tokens")
    buf = builder.buffers
    if num_rows > buf.seq_lens.shape[0]:
        raise RuntimeError(
            f"{num_rows} verify rows exceed the engine's {buf.seq_lens.shape[0]} generation rows "
            "(PyTorchModelEngine(tokens_per_generation=...))"
        )
    tpb = builder.tokens_per_block
    table = builder.block_table(requests)
    starts = np.fromiter((row.start for row in rows), dtype=np.int64, count=len(rows))
    pos = (starts[:, None] + np.arange(per_request)[None, :]).reshape(-1)
    owner = np.repeat(np.arange(len(rows)), per_request)
    ids = np.asarray([t for row in rows for t in row.tokens], dtype=np.int64)
    slot_mapping = table[owner, pos // tpb].astype(np.int64) * tpb + pos % tpb
    slots_host = np.repeat(np.asarray([r.seq_slot for r in requests], dtype=np.int64), per_request)
    ones = np.ones(num_rows, dtype=np.int32)
    cached = pos.astype(np.int32)
    cu = np.arange(num_rows + 1, dtype=np.int32)
    input_ids = builder._h2d(buf.input_ids, ids)
    metadata = AttentionMetadata(
        num_contexts=0,
        num_generations=num_rows,
        num_ctx_tokens=0,
        num_tokens=num_rows,
        seq_lens_cpu=torch.from_numpy(ones),
        num_cached_tokens_cpu=torch.from_numpy(cached),
        seq_lens=builder._h2d(buf.seq_lens, ones),
        num_cached_tokens=builder._h2d(buf.num_cached_tokens, cached),
        cu_seqlens_q=builder._h2d(buf.cu_seqlens_q, cu),
        block_tables=builder._h2d_columns(buf.block_tables, np.repeat(table, per_request, 0)),
        slot_mapping=builder._h2d(buf.slot_mapping, slot_mapping),
        seq_slots=builder._h2d(buf.seq_slots, slots_host),
        seq_slots_cpu=torch.from_numpy(slots_host),
        kv_cache_manager=builder.kv_cache_manager,
        tokens_per_block=tpb,
        tokens_per_generation=per_request,
    )
    host_pos = maybe_pin_memory(torch.from_numpy(cached))
    if builder.use_mrope:
        position_ids = buf.position_ids[:, :, :num_rows]
        position_ids.copy_(host_pos.view(1, 1, -1).expand(3, 1, -1), non_blocking=True)
    else:
        position_ids = buf.position_ids[:, :num_rows]
        position_ids.copy_(host_pos.view(1, -1), non_blocking=True)
    draft_positions = None
    if builder.use_mrope:
        deltas = torch.cat([generation_delta(builder, req)[1] for req in requests])
        draft_positions = position_ids + deltas.repeat_interleave(per_request).view(1, 1, -1)
    batch = InputBatch(attn_metadata=metadata, input_ids=input_ids, position_ids=position_ids)
    offsets = [i * per_request for i in range(len(rows))]
    return ChunkBatch(batch, offsets, [per_request] * len(rows), draft_positions)
