"""Varlen causal prefill over the paged KV cache (flash-attention style online softmax).

Each context request's queries sit at positions `num_cached .. num_cached + n - 1` and attend
to its whole cached prefix plus its own new tokens, all read back through the block table
(the new K/V are stored first). One program handles BLOCK_M queries of one request and one
query head; grid = (num_contexts, cdiv(max_new_tokens, BLOCK_M), num_heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


# NOTE: `stride_bt` (the block table's width) is a runtime value, as in decode.py: the MTP
# head's tables are as wide as its step's longest row, and a width of 1 or a multiple of 16
# would compile another variant inside a served step.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    num_cached_ptr,
    cu_seqlens_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    start_m = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    if start_m >= seq_len:
        return
    num_cached = tl.load(num_cached_ptr + req)
    q_start = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    kv_len = num_cached + seq_len
    kv_head = head // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HEAD_DIM
    row_ok = offs_m < seq_len
    rows = q_start + offs_m
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dmask[None, :],
        other=0.0,
    )
    q_pos = num_cached + offs_m  # absolute position of each query

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    # Causal: nothing past the last query of this tile is ever visible.
    kv_end = tl.minimum(kv_len, num_cached + start_m + BLOCK_M)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < kv_end
        block = tl.load(table + offs_n // tokens_per_block, mask=key_ok, other=0)
        block = tl.maximum(block, 0).to(tl.int64)
        base = block * stride_cb + (offs_n % tokens_per_block) * stride_ct + kv_head * stride_ch
        kv_mask = key_ok[:, None] & dmask[None, :]
        # other=0 keeps never-written (possibly NaN) slots out of the dot products.
        k = tl.load(cache_ptr + base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + stride_ckv + base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        # NOTE: key 0 is visible to every row (valid or padded) of the first tile, so each
        # row's running max is finite after one iteration and no exp(-inf - -inf) NaN appears.
        visible = key_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dmask[None, :],
    )


def _tile_sizes(head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). Small tiles in the interpreter exercise the tile logic
    on tiny test sequences. On the GPU, 64x64 tiles; wide heads take narrower key tiles and
    more warps so the fp32 accumulator [BLOCK_M, head_dim] does not spill."""
    if device.type != "cuda":
        return 16, 16, 4
    if head_dim <= 128:
        return 64, 64, 4
    return 64, 32, 8


def paged_prefill(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_buffer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_cached_tokens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    num_contexts: int,
    max_new_tokens: int,
    scale: float,
) -> None:
    """Causal attention of the first `num_contexts` requests, written into `out`.

    `q, out: [T, H, D]` (the contexts' tokens are rows `cu_seqlens_q[b]..`); `kv_buffer:
    [blocks, 2, tpb, KVH, D]` already holds the new K/V; `block_tables: [B, max_blocks]`
    int32; `seq_lens, num_cached_tokens: [B]`, `cu_seqlens_q: [B+1]` device tensors.
    `max_new_tokens` is a host bound on `seq_lens[:num_contexts]` (sizes the grid).
    """
    if num_contexts == 0 or max_new_tokens == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_buffer.shape[3]
    if q.stride(-1) != 1 or out.stride(-1) != 1 or kv_buffer.stride(-1) != 1:
        raise ValueError("q, out and kv_buffer must be contiguous in their last dimension")
    block_m, block_n, num_warps = _tile_sizes(head_dim, q.device)
    grid = (num_contexts, triton.cdiv(max_new_tokens, block_m), num_heads)
    _prefill_kernel[grid](
        q,
        out,
        kv_buffer,
        block_tables,
        seq_lens,
        num_cached_tokens,
        cu_seqlens_q,
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
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # fp32 inputs get exact fp32 products (TF32 would break tight parity tests).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
