"""MoE routing in two launches: softmax + top-k per token, then the expert-sorted block layout.

`moe_route`: one program per token row of the router logits `[T, E]` (or `[T, E + 1]` with a
fused shared expert, see `modules/fused_moe/shared_fusion.py`): a float32 softmax over the E routed
logits, top-k by k rounds of argmax over the register tile, optional renormalisation, and
(with `shared_expert`) a last pair `(E, sigmoid(logit_E))`.

`moe_align`: the layout of `moe_align_block_size` (`fused_moe.py`): every expert's run padded
to BLOCK_M, `block_expert` per M-block and each pair's slot, one program per chunk of 128
pairs. Each program histograms all pairs (`tl.histogram`) to get the runs' starts and the
counts of the chunks before its own, then places its chunk's pairs by their ranks inside the
chunk. Pairs keep their order inside an expert's run, so the layout equals the torch path's
stable sort bit for bit. No host sync, no sort and no atomics: both kernels are CUDA-graph
safe. (A single program walking the chunks in turn took 52 us per layer at 128 tokens x 9
pairs on the H200, latency-bound; chunks in parallel remove the serial walk.)

Ties: among equal probabilities the kernel picks the lowest expert ids, best first. That is the
set torch.topk picks on CUDA (its gatherTopK fills the k-th value's ties in index order), and
HF routes with torch.topk; the order inside a tie may differ, which changes nothing. The CPU
torch.topk may pick other ids on a tie at the k-th place. Ties are common in bf16: with 256
experts about 8% of random tokens have one between the 8th and 9th probability.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton

# Each alignment program re-reads every pair to histogram them: beyond this many pairs the
# torch path (a sort) is cheaper.
ALIGN_MAX_PAIRS = 8192
ROUTE_MAX_EXPERTS = 1024
ROUTE_MAX_TOP_K = 16
_ALIGN_CHUNK = 128  # pairs placed per program (a [128, 128] comparison tile)
_ALIGN_HIST = 1024  # pairs per histogram round
Layout = tuple[torch.Tensor, torch.Tensor]  # (sorted_pairs, block_expert) of `fused_moe.py`


@triton_jit
def _route_kernel(
    logits_ptr, ids_ptr, weights_ptr, stride_l,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid (T,): ids/weights rows have TOP_K + SHARED entries.
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < NUM_EXPERTS
    logit = tl.load(logits_ptr + row * stride_l + offs_e, mask=mask_e, other=float("-inf"))
    logit = logit.to(tl.float32)
    prob = tl.exp(logit - tl.max(logit, axis=0))
    prob = prob / tl.sum(prob, axis=0)
    # Masked lanes get -1 so they never win an argmax (every real probability is >= 0).
    prob = tl.where(mask_e, prob, -1.0)
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(prob, axis=0)
        # The lowest id among ties, as documented above.
        idx = tl.min(tl.where(prob == best, offs_e, BLOCK_E), axis=0)
        top_w = tl.where(offs_k == j, best, top_w)
        top_id = tl.where(offs_k == j, idx, top_id)
        prob = tl.where(offs_e == idx, -2.0, prob)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(offs_k < TOP_K, top_w, 0.0), axis=0)
    width: tl.constexpr = TOP_K + SHARED
    if SHARED:  # the shared expert's gate logit sits right after the routed ones
        gate = tl.load(logits_ptr + row * stride_l + NUM_EXPERTS).to(tl.float32)
        top_w = tl.where(offs_k == TOP_K, tl.sigmoid(gate), top_w)
        top_id = tl.where(offs_k == TOP_K, NUM_EXPERTS, top_id)
    mask_k = offs_k < width
    tl.store(ids_ptr + row * width + offs_k, top_id, mask=mask_k)
    top_w = top_w.to(weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + row * width + offs_k, top_w, mask=mask_k)


@triton_jit(do_not_specialize=("num_pairs", "num_blocks"))
def _align_kernel(
    ids_ptr, base_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_blocks,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid (ceil(num_pairs / BLOCK_P),): program c places the pairs of chunk c. base_ptr:
    # [grid, BLOCK_E] int32 scratch, row c = where chunk c's first pair of each expert goes.
    chunk = tl.program_id(0)
    nprog = tl.num_programs(0)
    chunk_start = chunk * BLOCK_P
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < NUM_EXPERTS
    offs_h = tl.arange(0, BLOCK_H)
    # Every program histograms all pairs (and those of the chunks before its own) by itself:
    # a few KB of ids re-read from L2 cost less than a second launch or a grid-wide barrier.
    # Masked lanes and dropped pairs (id NUM_EXPERTS) count in bins that are no expert.
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    # NOTE: `while` loops, not `range`, over runtime bounds: the interpreter (CPU tests) cannot
    # take a runtime scalar as a range bound.
    c = 0
    while c < num_pairs:
        pairs = c + offs_h
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=NUM_EXPERTS)
        total += tl.histogram(ids, BLOCK_E)
        before += tl.histogram(tl.where(pairs < chunk_start, ids, NUM_EXPERTS), BLOCK_E)
        c += BLOCK_H
    counts = tl.where(mask_e, total, 0)
    run_blocks = (counts + BLOCK_M - 1) // BLOCK_M
    starts = (tl.cumsum(run_blocks, axis=0) - run_blocks) * BLOCK_M
    # This chunk's pairs: an expert's run holds the earlier chunks' pairs first, then these in
    # pair order (ranks from comparisons inside the chunk), so the layout is a stable sort.
    base_row = base_ptr + chunk * BLOCK_E
    tl.store(base_row + offs_e, starts + before)
    tl.debug_barrier()  # the row is written before its lanes gather from it
    offs_p = tl.arange(0, BLOCK_P)
    pairs = chunk_start + offs_p
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=NUM_EXPERTS)
    valid = (pairs < num_pairs) & (ids < NUM_EXPERTS)
    same = (ids[:, None] == ids[None, :]) & valid[None, :]
    rank = tl.sum((same & (offs_p[None, :] < offs_p[:, None])).to(tl.int32), axis=1)
    dest = tl.load(base_row + ids, mask=valid, other=0) + rank
    tl.store(sorted_ptr + dest, pairs, mask=valid)
    # Rows that hold no pair point past the last one: each run's padding (rows j of a run's
    # tail, j spread over the programs) and the unused tail; none of them is a pair's row, so
    # the programs never write the same row.
    pad_start = starts + counts
    pad = run_blocks * BLOCK_M - counts
    j = chunk
    while j < BLOCK_M:
        tl.store(sorted_ptr + pad_start + j, num_pairs, mask=mask_e & (j < pad))
        j += nprog
    used_blocks = tl.sum(run_blocks, axis=0)
    offs_r = tl.arange(0, BLOCK_R)
    r0 = used_blocks * BLOCK_M + chunk * BLOCK_R
    while r0 < num_blocks * BLOCK_M:
        rows = r0 + offs_r
        tl.store(sorted_ptr + rows, num_pairs, mask=rows < num_blocks * BLOCK_M)
        r0 += nprog * BLOCK_R
    # The expert of each block: one block of every run per round (a run has at most
    # T / BLOCK_M + 1 blocks, an expert gets each token at most once), then the unused tail
    # as the "empty" expert NUM_EXPERTS.
    first_block = starts // BLOCK_M
    longest = tl.max(run_blocks, axis=0)
    j = chunk
    while j < longest:
        tl.store(block_expert_ptr + first_block + j, offs_e, mask=mask_e & (j < run_blocks))
        j += nprog
    b0 = used_blocks + chunk * BLOCK_R
    while b0 < num_blocks:
        blocks = b0 + offs_r
        tl.store(block_expert_ptr + blocks, NUM_EXPERTS, mask=blocks < num_blocks)
        b0 += nprog * BLOCK_R


def route_ref(
    logits: torch.Tensor, top_k: int, renormalize: bool = True, shared_expert: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch routing: (weights [T, k (+1)] in the logits' dtype, ids [T, k (+1)] int64).

    Softmax over the routed logits in float32, top-k best first, optional renormalisation;
    with `shared_expert` the last logit column is the shared expert's gate and each row gets
    one more pair `(E, sigmoid(gate))`, the sigmoid in float32 and then cast like HF's.
    """
    num_experts = logits.shape[-1] - int(shared_expert)
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = F.softmax(logits[:, :num_experts], dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if shared_expert:
        gate = torch.sigmoid(logits[:, num_experts:].float())
        weights = torch.cat([weights, gate], dim=-1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], num_experts)], dim=-1)
    # The cast matches HF, which scales the expert outputs by weights in the model dtype.
    return weights.to(logits.dtype), ids


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded layout: each of at most min(E, pairs) runs pads by < block_m."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Layout:
    """`moe_align_block_size`'s layout (sorted_pairs, block_expert, both int32) in one Triton
    launch. Ids in `[0, E]`: id E (a dropped pair, `fused_moe(dropped=True)`) is never placed."""
    num_pairs = topk_ids.numel()
    if num_pairs > ALIGN_MAX_PAIRS or num_experts > ROUTE_MAX_EXPERTS:
        raise ValueError(f"moe_align: at most {ALIGN_MAX_PAIRS} pairs and {ROUTE_MAX_EXPERTS} "
                         f"experts, got {num_pairs} and {num_experts}")  # fmt: skip
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int32)
    num_blocks = -(-align_capacity(num_pairs, num_experts, block_m) // block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    grid = max(1, -(-num_pairs // _ALIGN_CHUNK))
    # One bin more than the experts: the dropped id E and masked lanes count there.
    bins = triton.next_power_of_2(num_experts + 1)
    base = torch.empty(grid, bins, dtype=torch.int32, device=dev)
    _align_kernel[(grid,)](
        ids, base, sorted_pairs, block_expert, num_pairs, num_blocks,
        NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_E=bins, BLOCK_P=_ALIGN_CHUNK,
        BLOCK_H=_ALIGN_HIST, BLOCK_R=1024, num_warps=8,
        **pdl_launch_kwargs(dev, grid),
    )  # fmt: skip
    return sorted_pairs, block_expert


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    shared_expert: bool = False,
    block_m: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, Layout | None]:
    """(weights, ids int32 on Triton / int64 on torch, layout) of `route_ref`'s routing.

    With `block_m`, the Triton path also returns the aligned layout for the expert kernels
    (`fused_moe(..., layout=)`); the torch path and the large-batch case return None, and the
    expert kernel then aligns by itself.
    """
    if logits.dim() != 2:
        raise ValueError(f"moe_route expects logits [T, E], got {tuple(logits.shape)}")
    if logits.stride(-1) != 1:  # rows may be strided (the router's padded columns), not columns
        logits = logits.contiguous()
    num_tokens, width = logits.shape
    num_experts = width - int(shared_expert)
    ok = top_k <= ROUTE_MAX_TOP_K and width <= ROUTE_MAX_EXPERTS and num_tokens > 0
    if not ok or not use_triton("moe_route", logits.device, backend):
        weights, ids = route_ref(logits, top_k, renormalize, shared_expert)
        return weights, ids, None
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    k_total = top_k + int(shared_expert)
    dev = logits.device
    ids = torch.empty(num_tokens, k_total, dtype=torch.int32, device=dev)
    weights = torch.empty(num_tokens, k_total, dtype=logits.dtype, device=dev)
    align = block_m is not None and num_tokens * k_total <= ALIGN_MAX_PAIRS
    _route_kernel[(num_tokens,)](
        logits, ids, weights, logits.stride(0),
        NUM_EXPERTS=num_experts, TOP_K=top_k, RENORMALIZE=renormalize, SHARED=shared_expert,
        BLOCK_E=triton.next_power_of_2(width), BLOCK_K=triton.next_power_of_2(k_total),
        num_warps=4 if width > 128 else 1, **pdl_launch_kwargs(dev, num_tokens),
    )  # fmt: skip
    if not align:
        return weights, ids, None
    assert block_m is not None
    return weights, ids, moe_align(ids, width, block_m)
