"""Scatter new K/V rows into the paged cache; slot -1 rows are skipped inside the kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...modules.triton_kernels import pdl_launch_kwargs, pdl_sync
from ...modules.triton_kernels.fp8_quant import FP8_MAX as _FP8_MAX

FP8_MAX: tl.constexpr = tl.constexpr(_FP8_MAX)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_ct,
    stride_ch,
    tokens_per_block,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SATURATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # NOTE: slot -1 (padding) folds into the mask, so padded rows cost a load and no store,
    # and the host never has to look at slot_mapping.
    mask = (slot >= 0) & (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    safe_slot = tl.maximum(slot, 0)
    block = safe_slot // tokens_per_block
    offset = safe_slot % tokens_per_block
    dst = cache_ptr + block * stride_cb + offset * stride_ct
    dst = dst + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    elem = cache_ptr.dtype.element_ty
    if SATURATE:  # fp8 cache: clamp so outliers saturate instead of becoming NaN
        k = tl.clamp(k.to(tl.float32), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32), -FP8_MAX, FP8_MAX)
    tl.store(dst, k.to(elem), mask=mask)
    tl.store(dst + stride_ckv, v.to(elem), mask=mask)


def store_kv(
    kv_buffer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `k, v: [N, num_kv_heads, head_dim]` into `kv_buffer` at `slot_mapping: [>=N]`.

    `kv_buffer: [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]`; rows whose slot is
    -1 are skipped; values are converted to the cache dtype (saturating at +-448 for an fp8
    cache). No host sync.
    """
    if kv_buffer.dim() != 5 or kv_buffer.shape[1] != 2:
        raise ValueError(f"kv_buffer must be [blocks, 2, tpb, kv_heads, D], got {kv_buffer.shape}")
    _, _, tokens_per_block, num_kv_heads, head_dim = kv_buffer.shape
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k/v must both be [N, {num_kv_heads}, {head_dim}], got {k.shape} and {v.shape}"
        )
    if slot_mapping.shape[0] < k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} rows for {k.shape[0]} tokens")
    if kv_buffer.stride(-1) != 1:
        raise ValueError("kv_buffer must be contiguous in its last dimension")
    if k.shape[0] == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        kv_buffer,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_buffer.stride(0),
        kv_buffer.stride(1),
        kv_buffer.stride(2),
        kv_buffer.stride(3),
        tokens_per_block,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        SATURATE=kv_buffer.dtype == torch.float8_e4m3fn,
        **pdl_launch_kwargs(k.device, k.shape[0]),
    )
