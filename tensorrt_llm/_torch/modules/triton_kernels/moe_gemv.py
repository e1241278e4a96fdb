"""MoE experts at a handful of tokens as two GEMV kernels: no expert-sorted layout at all.

With 1-4 tokens the grouped GEMM (`fused_moe.py`) pads each pair to a 16-row tile and needs
the alignment kernel first. Here:
1. `_gemv_gate_up_kernel`, grid (pairs, I / BLOCK_N): each program reads its pair's token row
   and one N-slice of the pair's expert gate and up rows; writes `silu(gate) * up` in x's dtype.
2. `_gemv_down_kernel`: per pair (grid (T*k, H / BLOCK_N)) `weight * (act @ down^T)` as an
   fp32 partial, then `_sum_pairs_kernel` adds a token's k partials in pair order; or per
   token (grid (T, H / BLOCK_N), `GemvTiles.down_per_pair=False`): each program walks its
   token's k pairs and writes the output directly (one launch fewer, k times fewer programs).
   Either way there are no atomics and the sum order is fixed (deterministic).
Each expert weight byte streams once per pair that uses it; with few tokens the pairs rarely
share an expert, so that is the minimum traffic. A dropped pair (id E, expert parallelism)
reads no weight at all. 16-bit weights only (block-FP8 experts take
the grouped GEMM).
"""

from __future__ import annotations

import torch

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit
from .moe_tiles import GEMV_TILES, GemvTiles


@triton_jit
def _gemv_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, act_ptr, stride_xt, stride_we, stride_wn, stride_at,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    # A dropped pair (id NUM_EXPERTS) computes nothing; the down kernel never reads its row.
    if expert < NUM_EXPERTS:
        token = pair // TOP_K
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < INTER
        gate_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < HIDDEN
            x = tl.load(x_ptr + token * stride_xt + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            mask = mask_n[:, None] & mask_k[None, :]
            gate = tl.load(gate_ptrs + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gate_ptrs + INTER * stride_wn + offs_k[None, :], mask=mask, other=0.0)
            acc_gate += tl.sum(gate * x[None, :], axis=1)
            acc_up += tl.sum(up.to(tl.float32) * x[None, :], axis=1)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(act_ptr + pair * stride_at + offs_n, act.to(act_ptr.dtype.element_ty), mask=mask_n)


@triton_jit
def _gemv_down_kernel(
    act_ptr, w_ptr, ids_ptr, topk_w_ptr, out_ptr, stride_at, stride_we, stride_wn, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, ROW_PAIRS: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # grid (rows, H / BLOCK_N): a row is a token (ROW_PAIRS = k, the output in x's dtype) or a
    # pair (ROW_PAIRS = 1, an fp32 partial that `_sum_pairs_kernel` adds up).
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(ROW_PAIRS):
        pair = row * ROW_PAIRS + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        if expert < NUM_EXPERTS:  # a dropped pair adds nothing: its term is skipped
            w_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < INTER
                a = tl.load(act_ptr + pair * stride_at + offs_k, mask=mask_k, other=0.0)
                mask_w = mask_n[:, None] & mask_k[None, :]
                w = tl.load(w_ptrs + offs_k[None, :], mask=mask_w, other=0.0)
                acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
            # Weighted per pair as the reference does: (act @ down^T) * weight, then the k-sum.
            out += acc * tl.load(topk_w_ptr + pair).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton_jit
def _sum_pairs_kernel(
    part_ptr, out_ptr, stride_pt, stride_ot,
    HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # grid (T, H / BLOCK): the k partials of a token in pair order (deterministic), cast once.
    pdl_sync(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(part_ptr + (token * TOP_K + j) * stride_pt + offs, mask=mask, other=0.0)
    tl.store(out_ptr + token * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe_gemv(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiles: GemvTiles = GEMV_TILES,
) -> torch.Tensor:
    """`fused_moe` for a few tokens (inputs already checked by `fused_moe`): [T, H] -> [T, H].
    Ids in `[0, E]`: a dropped pair (id E) reads no weights and adds nothing."""
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = down_proj.shape[0], down_proj.shape[2], topk_ids.shape[1]
    x, w1, w2 = x.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    block_k1 = min(tiles.block_k, triton.next_power_of_2(hidden))
    grid1 = (num_tokens * top_k, triton.cdiv(inter, tiles.gate_up_n))
    _gemv_gate_up_kernel[grid1](
        x, w1, ids, act, x.stride(0), w1.stride(0), w1.stride(1), act.stride(0),
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, NUM_EXPERTS=num_experts,
        BLOCK_N=tiles.gate_up_n, BLOCK_K=block_k1,
        num_warps=tiles.num_warps, **pdl_launch_kwargs(x.device, grid1[0] * grid1[1]),
    )  # fmt: skip
    out = torch.empty_like(x)
    block_k2 = min(tiles.block_k, triton.next_power_of_2(inter))
    per_pair = tiles.down_per_pair
    # Per pair: k times the programs (a token's serial walk over k experts leaves the memory
    # system idle at batch 1), then a deterministic k-sum; per token: no partials, one launch.
    dest = out
    if per_pair:
        dest = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    grid2 = (num_tokens * (top_k if per_pair else 1), triton.cdiv(hidden, tiles.down_n))
    _gemv_down_kernel[grid2](
        act, w2, ids, weights, dest, act.stride(0), w2.stride(0), w2.stride(1), dest.stride(0),
        HIDDEN=hidden, INTER=inter, ROW_PAIRS=1 if per_pair else top_k, NUM_EXPERTS=num_experts,
        BLOCK_N=tiles.down_n, BLOCK_K=block_k2,
        num_warps=tiles.num_warps, **pdl_launch_kwargs(x.device, grid2[0] * grid2[1]),
    )  # fmt: skip
    if per_pair:
        grid3 = (num_tokens, triton.cdiv(hidden, 1024))
        _sum_pairs_kernel[grid3](
            dest, out, dest.stride(0), out.stride(0),
            HIDDEN=hidden, TOP_K=top_k, BLOCK=1024,
            num_warps=4, **pdl_launch_kwargs(x.device, grid3[0] * grid3[1]),
        )  # fmt: skip
    return out
