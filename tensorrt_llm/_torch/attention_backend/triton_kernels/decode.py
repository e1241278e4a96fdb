"""Paged decode (flash-decoding): one query per generation request, split-K over the KV length.

Kernel 1 runs grid (num_generations, num_heads, num_splits): each program walks its share of
the request's `num_cached + seq_len` tokens through the block table and keeps an online
softmax. With one split it writes the output directly; otherwise it writes an unnormalised
partial (acc, max, sum) and kernel 2 merges the splits.
NOTE: CUDA-graph safe. Lengths and block ids are read on the device; the host only supplies
shapes and the constant `num_splits`, so a captured launch stays valid for new lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Fewest keys worth giving a split of their own, and the cap on splits per launch.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 16
# Programs that roughly fill an H200 (132 SMs, a few resident programs each).
_TARGET_PROGRAMS = 528


@triton.jit
def _decode_split_kernel(
    q_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    num_cached_ptr,
    req_offset,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_ct,
    stride_ch,
    stride_bt,
    tokens_per_block,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1)
    req = (req_offset + row).to(tl.int64)
    kv_len = tl.load(num_cached_ptr + req) + tl.load(seq_lens_ptr + req)
    split_len = tl.cdiv(kv_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + dims, mask=dmask, other=0.0)
    q = q.to(tl.float32)
    table = block_tables_ptr + req * stride_bt
    kv_head = head // GROUP
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    # An empty split (start >= end) skips the loop and reports max -inf, sum 0.
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end
        # Clamp: a padded graph row may carry -1 table entries; block 0 is always addressable.
        block = tl.load(table + offs_n // tokens_per_block, mask=key_ok, other=0)
        block = tl.maximum(block, 0).to(tl.int64)
        base = block * stride_cb + (offs_n % tokens_per_block) * stride_ct + kv_head * stride_ch
        kv_mask = key_ok[:, None] & dmask[None, :]
        k = tl.load(cache_ptr + base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.sum(q[None, :] * k.to(tl.float32), 1) * qk_scale
        s = tl.where(key_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new)
        v = tl.load(cache_ptr + stride_ckv + base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    if NUM_SPLITS == 1:
        out = acc / l_i
        tl.store(
            out_ptr + row * stride_ot + head * stride_oh + dims,
            out.to(out_ptr.dtype.element_ty),
            mask=dmask,
        )
    else:
        part = (row * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part * BLOCK_D + dims, acc)
        tl.store(part_ml_ptr + part * 2, m_i)
        tl.store(part_ml_ptr + part * 2 + 1, l_i)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < NUM_SPLITS
    part = (row * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=split_ok[:, None], other=0.0
    )
    # NOTE: split 0 always holds >= 1 key (kv_len >= 1), so m_max is finite and empty splits
    # (m = -inf) get weight exactly 0.
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - m_max)
    w = tl.where(split_ok, w, 0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def choose_num_splits(num_generations: int, num_heads: int, max_kv_len: int) -> int:
    """Host-only split count: enough programs to fill the GPU, never splits shorter than
    `_MIN_TOKENS_PER_SPLIT` of the longest possible context (`max_kv_len` is a static bound,
    not a live length, so a CUDA graph captured with it stays valid)."""
    by_length = triton.cdiv(max(max_kv_len, 1), _MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, max(num_generations * num_heads, 1))
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


def paged_decode(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_buffer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_cached_tokens: torch.Tensor,
    req_offset: int,
    scale: float,
    num_splits: int,
) -> None:
    """Attention of one query per generation request, written into `out`.

    `q, out: [G, H, D]` (row g belongs to request `req_offset + g`); `kv_buffer:
    [blocks, 2, tpb, KVH, D]` already holds the new K/V; request b attends to its first
    `num_cached_tokens[b] + seq_lens[b]` tokens through `block_tables[b]`.
    """
    num_gens, num_heads, head_dim = q.shape
    if num_gens == 0:
        return
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or kv_buffer.stride(-1) != 1:
        raise ValueError("q, out and kv_buffer must be contiguous in their last dimension")
    block_d = triton.next_power_of_2(head_dim)
    on_gpu = q.device.type == "cuda"
    block_n = (64 if head_dim <= 128 else 32) if on_gpu else 8
    part_acc = part_ml = out  # placeholders; unused when num_splits == 1
    if num_splits > 1:
        part_acc = torch.empty(
            (num_gens, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            (num_gens, num_heads, num_splits, 2), dtype=torch.float32, device=q.device
        )
    _decode_split_kernel[(num_gens, num_heads, num_splits)](
        q,
        out,
        part_acc,
        part_ml,
        kv_buffer,
        block_tables,
        seq_lens,
        num_cached_tokens,
        req_offset,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_buffer.stride(0),
        kv_buffer.stride(1),
        kv_buffer.stride(2),
        kv_buffer.stride(3),
        block_tables.stride(0),
        kv_buffer.shape[2],
        GROUP=num_heads // kv_buffer.shape[3],
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_gens, num_heads)](
            out,
            part_acc,
            part_ml,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
