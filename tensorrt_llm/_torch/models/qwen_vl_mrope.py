"""The mRoPE step helpers shared by every Qwen-VL model: the seq-slot delta cache.

`_prepare_qwen_vl_mrope_config` and `apply_generation_deltas` live here, below the model
classes, so `QwenVLModelBase` imports them without a cycle; `modeling_qwen2vl` re-exports them
under TensorRT-LLM's import path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

import torch

from ...inputs.multimodal import MROPE_POSITION_DELTAS, MultimodalParams


class QwenVLMropeStep(TypedDict):
    """`_prepare_qwen_vl_mrope_config`'s result (a plain dict at run time)."""

    mrope_rotary_cos_sin: torch.Tensor | None
    mrope_position_deltas: torch.Tensor


def _prepare_qwen_vl_mrope_config(
    mrope_position_deltas_cache: torch.Tensor,
    write_slots: torch.Tensor,
    read_slots: torch.Tensor,
    multimodal_params: Sequence[MultimodalParams],
    rotary_emb: Any | None,
    position_ids: torch.Tensor,
    num_ctx_tokens: int | None = None,
) -> QwenVLMropeStep:
    """Record context deltas in the seq-slot cache and read the generation deltas back.

    Args:
      mrope_position_deltas_cache: int32 [num_slots + 1]; the last entry is a dummy slot that is
        never written, so padded or delta-less rows read 0.
      write_slots: [C] seq slots of the step's context requests, in batch order.
      read_slots: [G] seq slots of the step's generation requests (dummy slot for padding).
      multimodal_params: one per context request, each carrying
        `mrope_config.mrope_position_deltas` ([1,1], any integer dtype, any device).
      rotary_emb: an `MRotaryEmbedding`; used only when the step has context tokens.
      position_ids: [3,1,T] positions of the step (context tokens first).
      num_ctx_tokens: context tokens at the front of `position_ids` (default: all of them when
        there are write slots, none otherwise).

    Returns `mrope_rotary_cos_sin` (packed cos/sin of the context tokens, or None on a pure
    generation step) and `mrope_position_deltas` ([G,1] int32 on the cache's device).
    """
    cache = mrope_position_deltas_cache
    deltas = [p.get(MROPE_POSITION_DELTAS) for p in multimodal_params]
    deltas = [d for d in deltas if d is not None]
    if len(deltas) != write_slots.numel():
        raise RuntimeError(
            f"mRoPE deltas and write slots differ: {len(deltas)} deltas for "
            f"{write_slots.numel()} context write slots"
        )
    if deltas:
        # NOTE: every delta is moved to the cache's device and dtype BEFORE the cat. A model
        # class that forgot the mRoPE device paths hands us CPU deltas; mixing them with a CUDA
        # cache is exactly the upstream "Expected all tensors to be on the same device" crash.
        moved = [d.reshape(-1).to(device=cache.device, dtype=cache.dtype) for d in deltas]
        slots = write_slots.to(device=cache.device, dtype=torch.long)
        cache.index_copy_(0, slots, torch.cat(moved))
    gen_slots = read_slots.to(device=cache.device, dtype=torch.long)
    gen_deltas = cache.index_select(0, gen_slots).view(-1, 1)

    if num_ctx_tokens is None:
        num_ctx_tokens = position_ids.shape[-1] if write_slots.numel() else 0
    cos_sin = None
    if num_ctx_tokens > 0 and rotary_emb is not None:
        cos_sin = rotary_emb.get_cos_sin(position_ids[:, 0, :num_ctx_tokens])
    return {"mrope_rotary_cos_sin": cos_sin, "mrope_position_deltas": gen_deltas}


def apply_generation_deltas(
    position_ids: torch.Tensor, mrope_position_deltas: torch.Tensor, num_ctx_tokens: int
) -> torch.Tensor:
    """Positions of generation tokens are past_len + delta, on all three axes.

    `position_ids` is [3,1,T] with generation rows holding past_len; returns a new tensor.
    Runs entirely on the device, so CUDA graphs read the live delta cache at replay.
    """
    num_gen = mrope_position_deltas.shape[0]
    if num_gen == 0:
        return position_ids
    out = position_ids.clone()
    gen = out[:, :, num_ctx_tokens : num_ctx_tokens + num_gen]
    gen += mrope_position_deltas.view(1, 1, -1).to(gen.dtype)
    return out
