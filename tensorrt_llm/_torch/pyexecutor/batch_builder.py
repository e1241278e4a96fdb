"""InputBatchBuilder: the scheduled requests of a step -> one `InputBatch`.

It builds the token, position and KV-slot arrays on the host (numpy, no device reads), copies
them into the persistent `InputBuffers` through pinned staging, and builds one
`AttentionMetadata`. Generation positions are `past_len` here; mRoPE models add the per-slot
delta on the device, so nothing in the decode step reads a device value. A generation row whose
last token is still in flight (overlap scheduler) takes it from the `SlotState` token pool, on
the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from ..._utils import async_tensor_h2d, maybe_pin_memory
from ...inputs.multimodal import (
    MROPE_POSITION_DELTAS,
    MROPE_POSITION_IDS,
    SPAN_MODALITIES,
    MultimodalParams,
    MultimodalRuntimeData,
    chunk_rows,
)
from ..attention_backend.interface import AttentionMetadata
from ..input_batch import InputBatch
from .input_buffers import InputBuffers
from .llm_request import LlmRequest
from .multimodal_checks import check_multimodal_request
from .prompt_logprobs import plan_prompt_logprobs
from .request_errors import RequestInputError
from .request_lifecycle import sample_rows
from .scheduler import ScheduledRequests

if TYPE_CHECKING:
    from .resource_manager import KVCacheManager
    from .slot_state import SlotState


class InputBatchBuilder:
    """Owns the step preparation over one engine's persistent buffers."""

    def __init__(
        self,
        buffers: InputBuffers,
        slot_state: SlotState,
        device: torch.device,
        *,
        use_mrope: bool,
        device_paths: list[str],
        max_num_tokens: int,
        max_batch_size: int,
        tokens_per_block: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.buffers = buffers
        self.slot_state = slot_state
        self.device = device
        self.use_mrope = use_mrope
        self.device_paths = device_paths
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.tokens_per_block = tokens_per_block
        self.max_blocks_per_seq = max_blocks_per_seq
        self.kv_cache_manager: KVCacheManager | None = None

    # ------------------------------------------------------------------ helpers
    def _h2d(self, dst: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        """Copy a host array into the leading rows of a persistent buffer; returns that view."""
        view = dst[: host.shape[0]]
        view.copy_(maybe_pin_memory(torch.from_numpy(host)), non_blocking=True)
        return view

    def _h2d_columns(self, dst: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        """Copy a host table into the leading rows and columns of a persistent buffer; returns
        the leading rows at full width (a static shape for graphs and kernels)."""
        view = dst[: host.shape[0]]
        view[:, : host.shape[1]].copy_(maybe_pin_memory(torch.from_numpy(host)), non_blocking=True)
        return view

    def _block_ids(self, req: LlmRequest) -> np.ndarray:
        if self.kv_cache_manager is None:
            raise RuntimeError("the engine has no KV cache manager")
        return self.kv_cache_manager.get_block_array(req.request_id)

    def block_table(self, requests: Sequence[LlmRequest]) -> np.ndarray:
        """[len(requests), width] int32 block ids, -1 past each row's blocks.

        NOTE: only as wide as the longest block list, not max_blocks_per_seq (8192 columns at
        a 262144-token max_seq_len: megabytes to fill and copy every step). Kernels read only
        what each row's kv_len covers."""
        row_blocks = [self._block_ids(req) for req in requests]
        width = max((b.shape[0] for b in row_blocks), default=0) or 1
        table = np.full((len(requests), width), -1, dtype=np.int32)
        for i, blocks in enumerate(row_blocks):
            table[i, : blocks.shape[0]] = blocks
        return table

    def _context_positions(self, req: LlmRequest, begin: int, end: int) -> torch.Tensor | None:
        """The chunk's mRoPE positions [3,1,n] (device or host), or None for text LLMs."""
        if not self.use_mrope:
            return None
        params = req.multimodal_params
        pos = params.get(MROPE_POSITION_IDS) if params is not None else None
        if pos is None:
            raise RequestInputError(
                [req.request_id],
                "no mrope_config.mrope_position_ids; every request to an mRoPE model must come "
                "through its input processor",
            )
        # The first chunk of this admission (after a prefix hit it starts past position 0).
        if begin == req.kv_start_position:
            check_multimodal_request(req)
        prompt_len = req.prompt_len
        if end <= prompt_len:
            return pos[:, :, begin:end]
        # A recompute after preemption: the generated tokens past the prompt sit where decode
        # put them, at their index plus the request's mRoPE delta (all three sections).
        delta = params.get(MROPE_POSITION_DELTAS) if params is not None else None
        offset = 0 if delta is None else delta.reshape(-1)[:1].to(pos.device, pos.dtype)
        tail = torch.arange(max(begin, prompt_len), end, device=pos.device, dtype=pos.dtype)
        tail = (tail + offset).view(1, 1, -1).expand(pos.shape[0], pos.shape[1], -1)
        if begin >= prompt_len:
            return tail
        return torch.cat([pos[:, :, begin:prompt_len], tail], dim=-1)

    def _prepare_multimodal(
        self, req: LlmRequest, begin: int, end: int
    ) -> tuple[MultimodalParams, MultimodalRuntimeData, dict[str, np.ndarray]]:
        """The request's params, this chunk's runtime counts (now `params.runtime`), and the
        chunk-relative rows of each modality's vision tokens (from the placeholder spans, never
        from tokens)."""
        # Only called once `_context_positions` found the params (it raises without them).
        params = cast(MultimodalParams, req.multimodal_params)
        if begin == req.kv_start_position:
            # A preempted request is prefilled again from the payload as it came (host).
            params.keep_for_recompute()
            # Once per request: move the listed tensors (mRoPE keys always among them).
            params.to_device(
                "multimodal_data",
                self.device,
                pin_memory=True,
                target_keywords=self.device_paths,
            )
        runtime = MultimodalRuntimeData(
            request_id=req.request_id, num_prefix_hit_tokens=req.kv_start_position
        )
        rows: dict[str, np.ndarray] = {}
        for kind in SPAN_MODALITIES:
            spans = params.spans(kind)
            if spans is None:
                continue
            cached, kind_rows = chunk_rows(spans[0], spans[1], begin, end)
            setattr(runtime, f"num_cached_{kind}_tokens", cached)
            setattr(runtime, f"num_{kind}_tokens_in_chunk", int(kind_rows.shape[0]))
            if kind_rows.shape[0]:
                rows[kind] = kind_rows
        params.runtime = runtime
        return params, runtime, rows

    def _media_rows(self, parts: list[tuple[MultimodalRuntimeData, str, np.ndarray]]) -> None:
        """One H2D copy of every vision row of the step; each runtime gets its own view."""
        if not parts:  # text-only steps: no copy at all
            return
        host = np.concatenate([rows for _, _, rows in parts])
        device_rows = async_tensor_h2d(torch.from_numpy(host), torch.int64, self.device)
        start = 0
        for runtime, kind, rows in parts:
            setattr(runtime, f"{kind}_rows", device_rows[start : start + rows.shape[0]])
            start += rows.shape[0]

    def _in_flight_tokens(self, gen: list[LlmRequest], first_row: int, first_token: int) -> None:
        """Generation rows whose last token is still on the device read it from the pool.

        Runs after the seq slots are on the device. The overlap scheduler's common case is every
        row in flight: one gather into the input ids, no index upload.
        """
        buf = self.buffers
        flight = [j for j, r in enumerate(gen) if r.num_in_flight_tokens]
        if not flight:
            return
        num_gen = len(gen)
        if len(flight) == num_gen:
            self.slot_state.last_tokens(
                buf.seq_slots[first_row : first_row + num_gen],
                buf.input_ids[first_token : first_token + num_gen],
            )
            return
        dst = async_tensor_h2d([first_token + j for j in flight], torch.int64, self.device)
        slots = async_tensor_h2d(
            [cast(int, gen[j].seq_slot) for j in flight], torch.int64, self.device
        )
        buf.input_ids.index_copy_(0, dst, self.slot_state.token_pool.index_select(0, slots))

    # ------------------------------------------------------------------ the step
    def build(
        self, scheduled: ScheduledRequests, return_context_logits: bool = False
    ) -> InputBatch:
        """Fill the input buffers for `scheduled` and describe the step."""
        ctx = list(scheduled.context_requests)
        gen = list(scheduled.generation_requests)
        requests = ctx + gen
        if len(requests) > self.max_batch_size:
            raise RuntimeError(f"batch of {len(requests)} exceeds max_batch_size")
        tpb = self.tokens_per_block
        num_ctx, num_gen = len(ctx), len(gen)
        block_table = self.block_table(requests)
        # Context chunks: a short loop (few requests, many tokens each).
        ids_parts: list[np.ndarray] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        mrope_ctx: list[tuple[int, torch.Tensor]] = []
        mm_params: list[MultimodalParams] = []
        media_rows: list[tuple[MultimodalRuntimeData, str, np.ndarray]] = []
        seq_lens = np.ones(len(requests), dtype=np.int32)
        cached = np.zeros(len(requests), dtype=np.int32)
        offset = 0
        for i, req in enumerate(ctx):
            begin = req.context_current_position
            end = begin + req.context_chunk_size
            ids_parts.append(req.context_token_array[begin:end])
            chunk_pos = self._context_positions(req, begin, end)
            if chunk_pos is not None:
                mrope_ctx.append((offset, chunk_pos))
                params, runtime, rows = self._prepare_multimodal(req, begin, end)
                mm_params.append(params)
                media_rows.extend((runtime, kind, r + offset) for kind, r in rows.items())
            tok = np.arange(begin, end)
            pos_parts.append(tok.astype(np.int32))
            slot_parts.append(block_table[i, tok // tpb].astype(np.int64) * tpb + tok % tpb)
            seq_lens[i] = end - begin
            cached[i] = begin
            offset += end - begin
        num_ctx_tokens = offset
        # Generation rows: one token each, vectorised over the batch. A row in flight gets a
        # 0 here and its token from the pool below.
        if num_gen:
            past = np.fromiter((r.num_tokens - 1 for r in gen), dtype=np.int64, count=num_gen)
            last = np.fromiter(
                (r.output_token_ids[-1] if not r.num_in_flight_tokens else 0 for r in gen),
                dtype=np.int64,
                count=num_gen,
            )
            ids_parts.append(last)
            pos_parts.append(past.astype(np.int32))
            gen_rows = np.arange(num_ctx, num_ctx + num_gen)
            slot_parts.append(
                block_table[gen_rows, past // tpb].astype(np.int64) * tpb + past % tpb
            )
            cached[num_ctx:] = past
            offset += num_gen
        num_tokens = offset
        if num_tokens > self.max_num_tokens:
            raise RuntimeError(f"step of {num_tokens} tokens exceeds max_num_tokens")

        self._media_rows(media_rows)
        buf = self.buffers
        input_ids = self._h2d(buf.input_ids, np.concatenate(ids_parts).astype(np.int64))
        host_pos = np.concatenate(pos_parts)
        if self.use_mrope:
            position_ids = buf.position_ids[:, :, :num_tokens]
            position_ids.copy_(
                maybe_pin_memory(torch.from_numpy(host_pos)).view(1, 1, -1).expand(3, 1, -1),
                non_blocking=True,
            )
            for start, chunk_pos in mrope_ctx:
                position_ids[:, :, start : start + chunk_pos.shape[-1]].copy_(
                    chunk_pos, non_blocking=True
                )
        else:
            position_ids = buf.position_ids[:, :num_tokens]
            position_ids.copy_(
                maybe_pin_memory(torch.from_numpy(host_pos)).view(1, -1), non_blocking=True
            )
        slot_mapping = self._h2d(buf.slot_mapping, np.concatenate(slot_parts))
        cu = np.zeros(len(requests) + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=cu[1:])
        slots_host = np.asarray([r.seq_slot for r in requests], dtype=np.int64)
        seq_slots = self._h2d(buf.seq_slots, slots_host)
        if num_gen:
            self._in_flight_tokens(gen, num_ctx, num_ctx_tokens)
        metadata = AttentionMetadata(
            num_contexts=num_ctx,
            num_generations=num_gen,
            num_ctx_tokens=num_ctx_tokens,
            num_tokens=num_tokens,
            seq_lens_cpu=torch.from_numpy(seq_lens),
            num_cached_tokens_cpu=torch.from_numpy(cached),
            seq_lens=self._h2d(buf.seq_lens, seq_lens),
            num_cached_tokens=self._h2d(buf.num_cached_tokens, cached),
            cu_seqlens_q=self._h2d(buf.cu_seqlens_q, cu),
            block_tables=self._h2d_columns(buf.block_tables, block_table),
            slot_mapping=slot_mapping,
            seq_slots=seq_slots,
            seq_slots_cpu=torch.from_numpy(slots_host),
            kv_cache_manager=self.kv_cache_manager,
            tokens_per_block=tpb,
            recurrent_snapshots=tuple(
                (i, r.inner_snapshot[0] - r.context_current_position, r.inner_snapshot[1])
                for i, r in enumerate(ctx)
                if r.inner_snapshot is not None
            ),
        )
        return InputBatch(
            attn_metadata=metadata,
            input_ids=input_ids,
            position_ids=position_ids,
            multimodal_params=mm_params,
            sample_rows=sample_rows(scheduled),
            return_context_logits=return_context_logits,
            prompt_logprobs=plan_prompt_logprobs(ctx, self.device),
        )
