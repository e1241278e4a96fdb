"""Fused MoE: expert-sorted padded block layout plus two Triton grouped GEMMs (SwiGLU experts).

Layout of `modules/fused_moe/experts.py`: `gate_up_proj: [E, 2*I, H]` (gate rows first) and
`down_proj: [E, H, I]`. Steps, all on the device with no host sync (CUDA-graph safe):
1. Align: sort the T*k (token, slot) pairs by expert into a fixed-size buffer where each
   expert's run is padded to a multiple of BLOCK_M, so every M-block has one expert. The buffer
   size is an upper bound known from shapes alone; unused blocks are marked empty. One Triton
   program does it (`moe_routing.moe_align`, or `moe_route` together with the routing);
   `moe_align_block_size` below is its torch twin, kept for very large steps and the tests.
2. GEMM 1 per block: `silu(x @ gate^T) * (x @ up^T)` -> `[T*k, I]` in the activation dtype.
3. GEMM 2 per block: `act @ down^T * routing_weight` -> `[T*k, H]` in the activation dtype
   (each pair's weighted output rounded once, as HF's experts round theirs), then a sum over k
   that accumulates in fp32 (or atomic fp32 adds into `[T, H]`, `moe_tiles.py`'s `combine`).
Tiles come from `moe_tiles.py` by the step's pair count; steps of a few tokens with 16-bit
weights skip the layout and take the GEMV kernels of `moe_gemv.py`.

Block-FP8 experts (`gate_up_scale_inv` / `down_scale_inv` given, weights e4m3 in the layout of
`fp8_block.py`): x and then `act` are quantized per 1 x bk group (`per_token_group_quant_fp8`)
before their GEMM, whose K tile is the scale block: each tile's fp8 dot is rescaled by the
row's group scale and the weight rows' block scales in fp32 (`BLOCK_SCALED`).
"""

from __future__ import annotations

import torch

from . import tl, triton, triton_jit, use_triton
from .fp8_block import FP8_DTYPE, check_block_scales, per_token_group_quant_fp8
from .fused_moe_ref import BlockScales, fused_moe_dense_ref, fused_moe_ref
from .moe_gemv import fused_moe_gemv
from .moe_routing import ALIGN_MAX_PAIRS, ROUTE_MAX_EXPERTS, Layout, moe_align
from .moe_tiles import GEMV_MAX_TOKENS, MoETiles, pick_tiles, token_class


@triton_jit(do_not_specialize=("num_pairs",))
def _gate_up_silu_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, x_scale_ptr, w_scale_ptr,
    stride_xt, stride_we, stride_wn, stride_wk, stride_ot, stride_xst, stride_wse, stride_wsn,
    num_pairs, num_experts,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_SCALED: tl.constexpr, W_BLOCK_N: tl.constexpr,
):  # fmt: skip
    # grid: (num_blocks, cdiv(INTER, BLOCK_N)); x [T, HIDDEN], w [E, 2*INTER, HIDDEN]. When
    # BLOCK_SCALED: x e4m3 with scales [T, HIDDEN / BLOCK_K], w e4m3 with scales
    # [E, 2*INTER / W_BLOCK_N, HIDDEN / BLOCK_K] (BLOCK_K is the scale block).
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < num_experts:  # Blocks past the last expert's run stay empty.
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        tokens = (pairs // TOP_K).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < INTER
        w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
        gate_scale_ptrs = ws_base + (offs_n // W_BLOCK_N) * stride_wsn
        up_scale_ptrs = ws_base + ((offs_n + INTER) // W_BLOCK_N) * stride_wsn
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < HIDDEN
            a = tl.load(
                x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                mask=valid[:, None] & mask_k[None, :],
                other=0.0,
            )
            w_mask = mask_k[:, None] & mask_n[None, :]
            w_ptrs = w_base + offs_k[:, None] * stride_wk
            gate = tl.load(w_ptrs, mask=w_mask, other=0.0)
            up = tl.load(w_ptrs + INTER * stride_wn, mask=w_mask, other=0.0)
            if BLOCK_SCALED:
                kb = k0 // BLOCK_K
                a_scale = tl.load(x_scale_ptr + tokens * stride_xst + kb, mask=valid, other=0.0)
                gate_scale = tl.load(gate_scale_ptrs + kb, mask=mask_n, other=0.0)
                up_scale = tl.load(up_scale_ptrs + kb, mask=mask_n, other=0.0)
                acc_gate += tl.dot(a, gate) * (a_scale[:, None] * gate_scale[None, :])
                acc_up += tl.dot(a, up) * (a_scale[:, None] * up_scale[None, :])
            else:
                acc_gate = tl.dot(a, gate, acc_gate, input_precision=PRECISION)
                acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton_jit(do_not_specialize=("num_pairs",))
def _down_weighted_kernel(
    act_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, topk_w_ptr, act_scale_ptr, w_scale_ptr,
    stride_at, stride_we, stride_wn, stride_wk, stride_ot, stride_ast, stride_wse, stride_wsn,
    num_pairs, num_experts,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_SCALED: tl.constexpr, W_BLOCK_N: tl.constexpr,
    ATOMIC: tl.constexpr,
):  # fmt: skip
    # grid: (num_blocks, cdiv(HIDDEN, BLOCK_N)); act [T*k, INTER], w [E, HIDDEN, INTER]; the
    # block-scaled layout as in `_gate_up_silu_kernel`. out: [T*k, HIDDEN] in act's dtype, or
    # with ATOMIC a zeroed [T, HIDDEN] fp32 that each pair adds into.
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < num_experts:
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = pairs.to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < HIDDEN
        w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
        w_scale_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_wse
        w_scale_ptrs += (offs_n // W_BLOCK_N) * stride_wsn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < INTER
            a = tl.load(
                act_ptr + rows[:, None] * stride_at + offs_k[None, :],
                mask=valid[:, None] & mask_k[None, :],
                other=0.0,
            )
            w = tl.load(
                w_base + offs_k[:, None] * stride_wk,
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            if BLOCK_SCALED:
                kb = k0 // BLOCK_K
                a_scale = tl.load(act_scale_ptr + rows * stride_ast + kb, mask=valid, other=0.0)
                w_scale = tl.load(w_scale_ptrs + kb, mask=mask_n, other=0.0)
                acc += tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
            else:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
        weight = tl.load(topk_w_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        if ATOMIC:
            out_ptrs = out_ptr + (rows // TOP_K)[:, None] * stride_ot + offs_n[None, :]
            tl.atomic_add(out_ptrs, acc, mask=valid[:, None] & mask_n[None, :], sem="relaxed")
        else:
            out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
            out = acc.to(out_ptr.dtype.element_ty)
            tl.store(out_ptrs, out, mask=valid[:, None] & mask_n[None, :])


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted, block-padded pair layout; device ops only, sizes from shapes alone.

    Returns `sorted_pairs` int32 `[num_blocks * block_m]` (pair id `t*k + slot`, or `T*k` for
    padding) and `block_expert` int32 `[num_blocks]` (the expert of each block, `num_experts` for
    an empty block). Ids in `[0, num_experts]`: id `num_experts` is a dropped pair (expert
    parallelism: routed to another rank's expert), left out of the layout.
    NOTE: at most min(E, T*k) experts get pairs and each pads by < block_m, so
    `T*k + min(E, T*k) * (block_m - 1)` rows always suffice.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    dev = flat.device
    capacity = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = -(-capacity // block_m)
    # One bucket more for the dropped id E; it never gets a run.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync for its size
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    run_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # dropped pairs sort last
    experts = flat[order]
    kept = experts < num_experts
    live = experts.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=dev) - run_start[live]
    dest = padded_end[live] - padded[live] + rank
    # A dropped pair lands in one scratch row past the layout, cut off below.
    rows = num_blocks * block_m
    dest = torch.where(kept, dest, rows)
    sorted_pairs = torch.full((rows + 1,), num_pairs, dtype=torch.int64, device=dev)
    sorted_pairs.scatter_(0, dest, order)
    sorted_pairs = sorted_pairs[:rows]
    block_start = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    return sorted_pairs.to(torch.int32), block_expert.to(torch.int32)


def _check_inputs(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    if x.dim() != 2 or gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError("fused_moe expects x [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I]")
    num_experts, two_inter, hidden = gate_up_proj.shape
    want_down = (num_experts, hidden, two_inter // 2)
    if x.shape[1] != hidden or two_inter % 2 or tuple(down_proj.shape) != want_down:
        raise ValueError(
            f"fused_moe shape mismatch: x {tuple(x.shape)}, gate_up_proj "
            f"{tuple(gate_up_proj.shape)}, down_proj {tuple(down_proj.shape)} (want {want_down})"
        )
    if (
        topk_ids.dim() != 2
        or topk_ids.shape != topk_weights.shape
        or topk_ids.shape[0] != x.shape[0]
    ):
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
            f"both be [T={x.shape[0]}, k]"
        )
    if topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be integer, got {topk_ids.dtype}")


def _block(size: int, cap: int) -> int:
    """Power-of-two tile edge: at least 16 (tl.dot's minimum), at most `cap`."""
    return min(cap, max(16, triton.next_power_of_2(size)))


def _check_block_scaled(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, scales: BlockScales
) -> None:
    if gate_up_proj.dtype != FP8_DTYPE or down_proj.dtype != FP8_DTYPE:
        raise ValueError(
            f"fused_moe with block scales needs e4m3 weights, got gate_up_proj "
            f"{gate_up_proj.dtype}, down_proj {down_proj.dtype}"
        )
    for name, w, scale, block in (
        ("gate_up_proj", gate_up_proj, scales.gate_up, scales.gate_up_block),
        ("down_proj", down_proj, scales.down, scales.down_block),
    ):
        if scale.dim() != 3 or scale.shape[0] != w.shape[0]:
            raise ValueError(
                f"fused_moe: {name} scales must be [E, ., .], got {tuple(scale.shape)}"
            )
        check_block_scales(w[0], scale[0], block, f"fused_moe {name}")


def expert_plan(
    num_tokens: int, top_k: int, num_experts: int, block_scaled: bool, block_m: int | None = None
) -> int | None:
    """The BLOCK_M the grouped GEMM will use for such a step, or None when the step takes the
    GEMV kernels (no layout needed): what `moe_route(..., block_m=)` should align for."""
    if not block_scaled and block_m is None and token_class(num_tokens) <= GEMV_MAX_TOKENS:
        return None
    return pick_tiles(num_tokens, top_k, num_experts, block_m, block_scaled).block_m


def gate_up_silu(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    layout: Layout,
    top_k: int,
    tiles: MoETiles,
    scales: BlockScales | None = None,
) -> torch.Tensor:
    """GEMM 1 over the aligned pairs: `silu(x @ gate^T) * (x @ up^T)` -> `[T*k, I]`, x's dtype
    (contiguous inputs; `bench_moe.py` calls it on its own to time tiles)."""
    num_tokens, hidden = x.shape
    num_experts, inter = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    sorted_pairs, block_expert = layout
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    block_n = _block(inter, tiles.gate_up_n)
    a, a_scale, s, block_k, w_bn = x, x, gate_up_proj, _block(hidden, tiles.gate_up_k), 1
    if scales is not None:  # the K tile is the scale block; act stays 16-bit for its quant
        block_k, w_bn = scales.gate_up_block[1], scales.gate_up_block[0]
        a, a_scale = per_token_group_quant_fp8(x, block_k)
        s = scales.gate_up.float().contiguous()
    w = gate_up_proj
    _gate_up_silu_kernel[(block_expert.shape[0], triton.cdiv(inter, block_n))](
        a, w, act, sorted_pairs, block_expert, a_scale, s,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), act.stride(0),
        a_scale.stride(0), s.stride(0), s.stride(1),
        num_tokens * top_k, num_experts,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        BLOCK_SCALED=scales is not None, W_BLOCK_N=w_bn,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return act


def down_weighted(
    act: torch.Tensor,
    down_proj: torch.Tensor,
    layout: Layout,
    topk_weights: torch.Tensor,
    tiles: MoETiles,
    scales: BlockScales | None = None,
    dropped: bool = False,
) -> torch.Tensor:
    """GEMM 2 and the k-sum: `sum_k weight * (act @ down^T)` -> `[T, H]` in act's dtype.
    `dropped`: the layout leaves some pairs out, so their per-pair rows must start at zero."""
    num_pairs, inter = act.shape
    num_experts, hidden = down_proj.shape[0], down_proj.shape[1]
    num_tokens, top_k = topk_weights.shape
    sorted_pairs, block_expert = layout
    precision = "ieee" if act.dtype == torch.float32 else "tf32"
    atomic = tiles.combine == "atomic"
    # No kernel writes a dropped pair's row: the k-sum then needs it zeroed. 16-bit partials
    # halve the bytes the prefill writes and the k-sum reads (~600 MB a layer at 8192 tokens).
    alloc = torch.zeros if atomic or dropped else torch.empty
    routed = alloc(num_tokens if atomic else num_pairs, hidden,
                   dtype=torch.float32 if atomic else act.dtype, device=act.device)  # fmt: skip
    weights = topk_weights.reshape(-1).contiguous()
    block_n = _block(hidden, tiles.down_n)
    a, a_scale, s, block_k, w_bn = act, act, down_proj, _block(inter, tiles.down_k), 1
    if scales is not None:
        block_k, w_bn = scales.down_block[1], scales.down_block[0]
        a, a_scale = per_token_group_quant_fp8(act, block_k)
        s = scales.down.float().contiguous()
    w = down_proj
    _down_weighted_kernel[(block_expert.shape[0], triton.cdiv(hidden, block_n))](
        a, w, routed, sorted_pairs, block_expert, weights, a_scale, s,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), routed.stride(0),
        a_scale.stride(0), s.stride(0), s.stride(1),
        num_pairs, num_experts,
        HIDDEN=hidden, INTER=inter, TOP_K=top_k,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        BLOCK_SCALED=scales is not None, W_BLOCK_N=w_bn, ATOMIC=atomic,
        num_warps=tiles.down_num_warps or tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if atomic:
        return routed.to(act.dtype)
    # NOTE: torch's sum of a 16-bit tensor accumulates in fp32 and rounds once.
    return routed.view(num_tokens, top_k, hidden).sum(dim=1)


def _fused_moe_triton(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiles: MoETiles,
    scales: BlockScales | None,
    layout: Layout | None = None,
    dropped: bool = False,
) -> torch.Tensor:
    num_experts, top_k = gate_up_proj.shape[0], topk_ids.shape[1]
    num_pairs = x.shape[0] * top_k
    x = x.contiguous()
    w1, w2 = gate_up_proj.contiguous(), down_proj.contiguous()
    if layout is None and num_pairs <= ALIGN_MAX_PAIRS and num_experts <= ROUTE_MAX_EXPERTS:
        layout = moe_align(topk_ids, num_experts, tiles.block_m)
    elif layout is None:
        layout = moe_align_block_size(topk_ids, num_experts, tiles.block_m)
    act = gate_up_silu(x, w1, layout, top_k, tiles, scales)
    return down_weighted(act, w2, layout, topk_weights, tiles, scales, dropped)


def fused_moe(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    backend: str = "auto",
    block_m: int | None = None,
    scales: BlockScales | None = None,
    layout: Layout | None = None,
    tiles: MoETiles | None = None,
    dropped: bool = False,
) -> torch.Tensor:
    """`sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`: x `[T, H]` -> `[T, H]`.

    With `scales`, the weights are block-FP8 (e4m3, `BlockScales` their scale_inv) and x is
    16-bit or fp32. `layout`: the aligned pairs for BLOCK_M `expert_plan(...)` from
    `moe_route` (saves the alignment launch); `tiles` overrides the table (benchmarks).
    `dropped`: some ids may be E, pairs that add nothing and are never computed (expert
    parallelism's pairs of other ranks, `local_routing`); every path here accepts them.
    NOTE: topk_ids must lie in `[0, E)`, or `[0, E]` with `dropped`; checking that on the
    device would need a host sync. The torch path is `fused_moe_ref`, or
    `fused_moe_dense_ref` during CUDA-graph capture.
    """
    _check_inputs(x, gate_up_proj, down_proj, topk_ids, topk_weights)
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if scales is not None:
        _check_block_scaled(x, gate_up_proj, down_proj, scales)
    elif gate_up_proj.dtype == FP8_DTYPE or down_proj.dtype == FP8_DTYPE:
        raise ValueError("fused_moe: e4m3 expert weights need their block scales (scales=)")
    if not use_triton("fused_moe", x.device, backend):
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        ref = fused_moe_dense_ref if capturing else fused_moe_ref
        return ref(x, gate_up_proj, down_proj, topk_ids, topk_weights, scales=scales)
    if scales is None and (x.dtype != gate_up_proj.dtype or x.dtype != down_proj.dtype):
        raise ValueError(
            f"fused_moe needs one dtype, got x {x.dtype}, gate_up_proj {gate_up_proj.dtype}, "
            f"down_proj {down_proj.dtype}"
        )
    if scales is not None:  # the kernel's K tile is the scale block
        for name, bk in (("gate_up", scales.gate_up_block[1]), ("down", scales.down_block[1])):
            if bk < 32 or bk > 256 or bk & (bk - 1):
                raise ValueError(f"fused_moe: the Triton kernel needs the {name} bk a power of "
                                 f"two in [32, 256], got {bk}; use backend='torch'")  # fmt: skip
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    num_experts, top_k = gate_up_proj.shape[0], topk_ids.shape[1]
    if tiles is None:
        plan = expert_plan(x.shape[0], top_k, num_experts, scales is not None, block_m)
        if plan is None:
            return fused_moe_gemv(x, gate_up_proj, down_proj, topk_ids, topk_weights)
        tiles = pick_tiles(x.shape[0], top_k, num_experts, block_m, scales is not None)
    if layout is not None and layout[0].numel() != layout[1].numel() * tiles.block_m:
        raise ValueError(f"fused_moe: the layout is not aligned to BLOCK_M {tiles.block_m}")
    return _fused_moe_triton(
        x, gate_up_proj, down_proj, topk_ids, topk_weights, tiles, scales, layout, dropped
    )
