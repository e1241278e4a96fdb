"""The InputBatch of a speculative step: every row is a chunk over the paged KV cache.

A verify row is a generation request's last token followed by its drafts (1 + k tokens at
positions past .. past + k); a replay row (recurrent rollback) is the accepted part of one.
Both are laid out like prefill chunks (`num_cached_tokens = past`), so the attention backends
and the Gated DeltaNet layers run them as chunked prefill with initial state; context chunks of
the step come first, as in `InputBatchBuilder.build`.

NOTE: mRoPE models take a verify row's positions as `index + delta` on all three axes, the
delta read on the device from the request's (prefill-stripped) params, so nothing syncs; the
params also ride along as a context row's, rewriting the same delta into the slot cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...._utils import maybe_pin_memory
from ....inputs.multimodal import MROPE_POSITION_DELTAS, MultimodalParams, MultimodalRuntimeData
from ...attention_backend.interface import AttentionMetadata
from ...input_batch import InputBatch
from ..prompt_logprobs import plan_prompt_logprobs
from ..request_errors import RequestInputError

if TYPE_CHECKING:
    from ..batch_builder import InputBatchBuilder
    from ..llm_request import LlmRequest


@dataclass
class ChunkRow:
    """Tokens of one generation request run as a chunk: `tokens[0]` sits at `start`."""

    request: LlmRequest
    tokens: list[int]
    start: int


@dataclass
class ChunkBatch:
    """The batch and where each row's tokens landed (host offsets into its `[T]` rows)."""

    batch: InputBatch
    offsets: list[int]  # first token row of each request, context requests first
    lengths: list[int]
    # The rows' positions with mRoPE deltas applied, where `batch.position_ids` holds them
    # without (a verify batch's generation rows: the model adds the deltas itself); the MTP
    # head reads these. None: `batch.position_ids`.
    draft_positions: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        return self.batch.position_ids if self.draft_positions is None else self.draft_positions


def _context_part(
    builder: InputBatchBuilder, req: LlmRequest, blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None, MultimodalParams | None, dict]:
    """A context request's chunk: ids, KV slots, mRoPE positions, params and media rows."""
    tpb = builder.tokens_per_block
    begin = req.context_current_position
    end = begin + req.context_chunk_size
    ids = req.context_token_array[begin:end]
    tok = np.arange(begin, end)
    slots = blocks[tok // tpb].astype(np.int64) * tpb + tok % tpb
    chunk_pos = builder._context_positions(req, begin, end)
    if chunk_pos is None:
        return ids, slots, None, None, {}
    params, runtime, rows = builder._prepare_multimodal(req, begin, end)
    return ids, slots, chunk_pos, params, {"runtime": runtime, "rows": rows}


def generation_delta(
    builder: InputBatchBuilder, req: LlmRequest
) -> tuple[MultimodalParams, torch.Tensor]:
    """A generation request's params (its delta) and the delta as a device scalar tensor."""
    params = req.multimodal_params
    delta = params.get(MROPE_POSITION_DELTAS) if params is not None else None
    if params is None or delta is None:
        raise RequestInputError(
            [req.request_id], "an mRoPE request reached decode without its mRoPE delta"
        )
    # NOTE: stripped after its last prefill chunk (no runtime): no media work for this row.
    return params, delta.reshape(-1)[:1].to(builder.device, torch.int32)


def build_chunk_batch(
    builder: InputBatchBuilder,
    context_requests: Sequence[LlmRequest],
    rows: Sequence[ChunkRow],
) -> ChunkBatch:
    """Fill `builder`'s persistent buffers with the context chunks then the chunk rows."""
    requests = [*context_requests, *(row.request for row in rows)]
    if len(requests) > builder.max_batch_size:
        raise RuntimeError(f"batch of {len(requests)} exceeds max_batch_size")
    tpb = builder.tokens_per_block
    block_table = builder.block_table(requests)
    ids_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    mrope_ctx: list[tuple[int, torch.Tensor]] = []
    mrope_gen: list[tuple[int, int, torch.Tensor]] = []
    mm_params: list[MultimodalParams] = []
    media_rows: list[tuple[MultimodalRuntimeData, str, np.ndarray]] = []
    offsets: list[int] = []
    lengths: list[int] = []
    cached = np.zeros(len(requests), dtype=np.int32)
    offset = 0
    for i, req in enumerate(context_requests):
        ids, slots, chunk_pos, params, media = _context_part(builder, req, block_table[i])
        begin = req.context_current_position
        if chunk_pos is not None and params is not None:
            mrope_ctx.append((offset, chunk_pos))
            mm_params.append(params)
            media_rows.extend((media["runtime"], k, r + offset) for k, r in media["rows"].items())
        ids_parts.append(np.asarray(ids, dtype=np.int64))
        pos_parts.append(np.arange(begin, begin + len(ids), dtype=np.int32))
        slot_parts.append(slots)
        offsets.append(offset)
        lengths.append(len(ids))
        cached[i] = begin
        offset += len(ids)
    for j, row in enumerate(rows):
        i = len(context_requests) + j
        n = len(row.tokens)
        tok = np.arange(row.start, row.start + n)
        ids_parts.append(np.asarray(row.tokens, dtype=np.int64))
        pos_parts.append(tok.astype(np.int32))
        slot_parts.append(block_table[i, tok // tpb].astype(np.int64) * tpb + tok % tpb)
        if builder.use_mrope:
            params, delta = generation_delta(builder, row.request)
            mm_params.append(params)
            mrope_gen.append((offset, n, delta))
        offsets.append(offset)
        lengths.append(n)
        cached[i] = row.start
        offset += n
    num_tokens = offset
    if num_tokens > builder.max_num_tokens:
        raise RuntimeError(f"step of {num_tokens} tokens exceeds max_num_tokens")
    builder._media_rows(media_rows)
    buf = builder.buffers
    input_ids = builder._h2d(buf.input_ids, np.concatenate(ids_parts))
    position_ids = _positions(builder, np.concatenate(pos_parts), mrope_ctx, mrope_gen)
    seq_lens = np.asarray(lengths, dtype=np.int32)
    cu = np.zeros(len(requests) + 1, dtype=np.int32)
    np.cumsum(seq_lens, out=cu[1:])
    slots_host = np.asarray([r.seq_slot for r in requests], dtype=np.int64)
    metadata = AttentionMetadata(
        num_contexts=len(requests),
        num_generations=0,
        num_ctx_tokens=num_tokens,
        num_tokens=num_tokens,
        seq_lens_cpu=torch.from_numpy(seq_lens),
        num_cached_tokens_cpu=torch.from_numpy(cached),
        seq_lens=builder._h2d(buf.seq_lens, seq_lens),
        num_cached_tokens=builder._h2d(buf.num_cached_tokens, cached),
        cu_seqlens_q=builder._h2d(buf.cu_seqlens_q, cu),
        block_tables=builder._h2d_columns(buf.block_tables, block_table),
        slot_mapping=builder._h2d(buf.slot_mapping, np.concatenate(slot_parts)),
        seq_slots=builder._h2d(buf.seq_slots, slots_host),
        seq_slots_cpu=torch.from_numpy(slots_host),
        kv_cache_manager=builder.kv_cache_manager,
        tokens_per_block=tpb,
    )
    batch = InputBatch(
        attn_metadata=metadata,
        input_ids=input_ids,
        position_ids=position_ids,
        multimodal_params=mm_params,
        prompt_logprobs=plan_prompt_logprobs(list(context_requests), builder.device),
    )
    return ChunkBatch(batch, offsets, lengths)


def _positions(
    builder: InputBatchBuilder,
    host_pos: np.ndarray,
    mrope_ctx: list[tuple[int, torch.Tensor]],
    mrope_gen: list[tuple[int, int, torch.Tensor]],
) -> torch.Tensor:
    """`[3, 1, T]` (mRoPE: context chunks' own positions, chunk rows index + delta) or `[1, T]`."""
    buf = builder.buffers
    num_tokens = host_pos.shape[0]
    host = maybe_pin_memory(torch.from_numpy(host_pos))
    if not builder.use_mrope:
        position_ids = buf.position_ids[:, :num_tokens]
        position_ids.copy_(host.view(1, -1), non_blocking=True)
        return position_ids
    position_ids = buf.position_ids[:, :, :num_tokens]
    position_ids.copy_(host.view(1, 1, -1).expand(3, 1, -1), non_blocking=True)
    for start, chunk_pos in mrope_ctx:
        position_ids[:, :, start : start + chunk_pos.shape[-1]].copy_(chunk_pos, non_blocking=True)
    for start, n, delta in mrope_gen:
        position_ids[:, :, start : start + n] += delta.to(position_ids.dtype)
    return position_ids
