"""Persistent, max-sized device input buffers. Each step only slices and copies into them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class InputBuffers:
    """Allocated once per engine; CUDA graphs capture views of these tensors.

    NOTE: nothing reallocates these tensors after construction. A step writes its inputs into
    the leading slice and hands views to the model.
    """

    input_ids: torch.Tensor  # [max_num_tokens] int64, device
    position_ids: torch.Tensor  # [3, 1, max_num_tokens] int32 (mRoPE) or [1, max_num_tokens]
    slot_mapping: torch.Tensor  # [max_num_tokens] int64, device (-1 = do not store)
    # Per row: a request, or one of an MTP verify step's rows (`max_batch_size` is then the
    # engine's `max_generation_rows`).
    seq_lens: torch.Tensor  # [max_batch_size] int32
    num_cached_tokens: torch.Tensor  # [max_batch_size] int32
    cu_seqlens_q: torch.Tensor  # [max_batch_size + 1] int32
    seq_slots: torch.Tensor  # [max_batch_size] int64
    block_tables: torch.Tensor  # [max_batch_size, max_blocks_per_seq] int32

    @classmethod
    def allocate(
        cls,
        max_num_tokens: int,
        max_batch_size: int,
        max_blocks_per_seq: int,
        use_mrope: bool,
        device: torch.device,
    ) -> InputBuffers:
        rows = 3 if use_mrope else 1
        pos_shape = (3, 1, max_num_tokens) if use_mrope else (rows, max_num_tokens)
        return cls(
            input_ids=torch.zeros(max_num_tokens, dtype=torch.long, device=device),
            position_ids=torch.zeros(pos_shape, dtype=torch.int32, device=device),
            slot_mapping=torch.full((max_num_tokens,), -1, dtype=torch.long, device=device),
            seq_lens=torch.zeros(max_batch_size, dtype=torch.int32, device=device),
            num_cached_tokens=torch.zeros(max_batch_size, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device),
            seq_slots=torch.zeros(max_batch_size, dtype=torch.long, device=device),
            block_tables=torch.full(
                (max_batch_size, max_blocks_per_seq), -1, dtype=torch.int32, device=device
            ),
        )
