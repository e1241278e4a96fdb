"""AttentionMetadata: the per-step description of the batch, built once by the engine.

Batch layout (TensorRT-LLM convention): context requests first, then generation requests.
Tokens are packed: T = num_ctx_tokens + num_generations (one token per generation request).
NOTE: plain fields only. Nothing here copies to the device behind the caller's back; the
engine fills the device tensors explicitly (pinned, non_blocking) when it builds the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

# flash-attn's paged KV cache takes pages of a multiple of this many tokens (checked by
# `LlmArgs` and the flash_attn backend).
FLASH_ATTN_PAGE_MULTIPLE = 256

if TYPE_CHECKING:
    from ..pyexecutor.resource_manager import KVCacheManager


@dataclass
class AttentionMetadata:
    num_contexts: int
    num_generations: int
    num_ctx_tokens: int
    num_tokens: int  # real (unpadded) tokens in the step
    # host copies, for Python-level loops in reference backends (no device sync needed)
    seq_lens_cpu: torch.Tensor  # [B] int32 new tokens per request this step
    num_cached_tokens_cpu: torch.Tensor  # [B] int32 tokens already in the KV cache
    # device copies
    seq_lens: torch.Tensor  # [B] int32
    num_cached_tokens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32, offsets of each request's new tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32 (block ids, -1 unused)
    slot_mapping: torch.Tensor  # [T_padded] int64, block*tokens_per_block+offset; -1 = skip
    seq_slots: torch.Tensor  # [B] int64 seq slot of each request (device)
    seq_slots_cpu: torch.Tensor  # [B] int64
    kv_cache_manager: KVCacheManager | None
    tokens_per_block: int
    # Hybrid prefix caching: (context row, offset in its chunk, scratch seq slot) per context
    # request whose recurrent state is snapshotted inside its chunk (gated_delta_net_snapshot).
    recurrent_snapshots: tuple[tuple[int, int, int], ...] = ()
    # MTP verify steps: a list the Gated DeltaNet layers' in-place rows path appends to
    # (`gated_delta_net_rows.RowsRecord`), for the rollback's replay; None records nothing.
    recurrent_record: list[Any] | None = None
    # MTP verify steps without context chunks (spec_decode/verify_batch.py): each generation
    # request's last token and drafts, `tokens_per_generation` of them, are that many
    # consecutive generation rows of one token each (row `past + t` of the request's cache),
    # so attention runs them as decode rows. Recurrent layers group each request's rows
    # again (`qwen3_next_recurrent.gdn_metadata`). `num_generations` counts the rows.
    tokens_per_generation: int = 1

    @property
    def num_seqs(self) -> int:
        return self.num_contexts + self.num_generations

    @property
    def is_pure_generation(self) -> bool:
        return self.num_contexts == 0
