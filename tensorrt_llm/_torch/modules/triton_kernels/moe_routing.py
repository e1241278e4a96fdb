"""MoE routing in two launches: softmax + top-k per token, then the expert-sorted block layout.

`moe_route`: one program per token row of the router logits `[T, E]` (or `[T, E + 1]` with a
fused shared expert, see `modules/fused_moe/shared_fusion.py`): a float32 softmax over the E routed
logits, top-k by k rounds of argmax over the register tile, optional renormalisation, and
(with `shared_expert`) a last pair `(E, sigmoid(logit_E))`. Optionally each program also adds
its k (+1) ids into a zeroed per-expert count buffer with atomics (`count_in_route`).

`moe_align`: a single program counts the pairs per expert (atomics into its scratch, unless
the routing counted) and turns the counts into the layout of `moe_align_block_size`
(`fused_moe.py`): every expert's run padded to BLOCK_M, `block_expert` per M-block and each
pair's slot. Pairs keep their order inside an expert's run (ranks come from comparisons inside
a chunk of pairs plus a per-expert cursor), so the layout equals the torch path's stable sort
bit for bit. No host sync and no sort: both kernels are CUDA-graph safe.

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

# The single-program alignment compares every pair of a chunk with every other (BLOCK_P^2) and
# with every expert (BLOCK_P x E): beyond this many pairs the torch path is cheaper.
ALIGN_MAX_PAIRS = 8192
ROUTE_MAX_EXPERTS = 1024
ROUTE_MAX_TOP_K = 16
_ALIGN_CHUNK = 128
Layout = tuple[torch.Tensor, torch.Tensor]  # (sorted_pairs, block_expert) of `fused_moe.py`


@triton_jit
def _route_kernel(
    logits_ptr, ids_ptr, weights_ptr, counts_ptr, stride_l,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr, HAS_COUNTS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
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
    if HAS_COUNTS:  # ids of one row are distinct, so the lanes never hit the same counter
        tl.atomic_add(counts_ptr + top_id, 1, mask=mask_k, sem="relaxed")


@triton_jit(do_not_specialize=("num_pairs", "num_blocks"))
def _align_kernel(
    ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_blocks,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, HAS_COUNTS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    # grid (1,). counts_ptr: [NUM_EXPERTS] int32, the per-expert counts when HAS_COUNTS (else
    # scratch); it is reused as each expert's write cursor.
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < NUM_EXPERTS
    offs_p = tl.arange(0, BLOCK_P)
    offs_r = tl.arange(0, BLOCK_R)
    if not HAS_COUNTS:  # a histogram by atomics (lanes may share an expert: each adds once)
        tl.store(counts_ptr + offs_e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=mask_e)
        tl.debug_barrier()
        c = 0
        while c < num_pairs:
            pairs = c + offs_p
            ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=0)
            # A dropped pair (id NUM_EXPERTS) has no counter: it never gets a slot.
            counted = (pairs < num_pairs) & (ids < NUM_EXPERTS)
            tl.atomic_add(counts_ptr + ids, 1, mask=counted, sem="relaxed")
            c += BLOCK_P
        tl.debug_barrier()
    counts = tl.load(counts_ptr + offs_e, mask=mask_e, other=0)
    run_blocks = (counts + BLOCK_M - 1) // BLOCK_M
    starts = (tl.cumsum(run_blocks, axis=0) - run_blocks) * BLOCK_M
    first_block = starts // BLOCK_M
    # NOTE: `while` loops, not `range`, over runtime bounds: the interpreter (CPU tests) cannot
    # take a runtime scalar as a range bound.
    # Each expert's blocks, one block of every run per round: a run has at most T / BLOCK_M + 1
    # blocks (an expert gets each token at most once), so decode takes one or two rounds.
    longest = tl.max(run_blocks, axis=0)
    j = 0
    while j < longest:
        tl.store(block_expert_ptr + first_block + j, offs_e, mask=mask_e & (j < run_blocks))
        j += 1
    b0 = tl.sum(run_blocks, axis=0)
    while b0 < num_blocks:  # the unused tail: the "empty" expert NUM_EXPERTS
        blocks = b0 + offs_r
        tl.store(block_expert_ptr + blocks, NUM_EXPERTS, mask=blocks < num_blocks)
        b0 += BLOCK_R
    r0 = 0
    while r0 < num_blocks * BLOCK_M:  # padding rows point past the last pair
        rows = r0 + offs_r
        tl.store(sorted_ptr + rows, num_pairs, mask=rows < num_blocks * BLOCK_M)
        r0 += BLOCK_R
    tl.debug_barrier()  # every lane has read the counts before they turn into cursors
    tl.store(counts_ptr + offs_e, starts, mask=mask_e)
    tl.debug_barrier()  # the padding and the cursors are written before any pair lands
    c = 0
    while c < num_pairs:
        pairs = c + offs_p
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        valid = (pairs < num_pairs) & (ids < NUM_EXPERTS)  # dropped pairs are left out
        same = (ids[:, None] == ids[None, :]) & valid[None, :]
        earlier = same & (offs_p[None, :] < offs_p[:, None])
        later = same & (offs_p[None, :] > offs_p[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        is_last = tl.sum(later.to(tl.int32), axis=1) == 0
        dest = tl.load(counts_ptr + ids, mask=valid, other=0) + rank
        tl.store(sorted_ptr + dest, pairs, mask=valid)
        tl.debug_barrier()  # every lane has read its cursor before the cursors move
        tl.store(counts_ptr + ids, dest + 1, mask=valid & is_last)
        tl.debug_barrier()
        c += BLOCK_P


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


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    counts: torch.Tensor | None = None,
) -> Layout:
    """`moe_align_block_size`'s layout (sorted_pairs, block_expert, both int32) in one Triton
    program; `counts` (int32 [E], from `moe_route`) skips the histogram and is overwritten.
    Ids in `[0, E]`: id E (a dropped pair, `fused_moe(dropped=True)`) is never placed."""
    num_pairs = topk_ids.numel()
    if num_pairs > ALIGN_MAX_PAIRS or num_experts > ROUTE_MAX_EXPERTS:
        raise ValueError(f"moe_align: at most {ALIGN_MAX_PAIRS} pairs and {ROUTE_MAX_EXPERTS} "
                         f"experts, got {num_pairs} and {num_experts}")  # fmt: skip
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int32)
    num_blocks = -(-align_capacity(num_pairs, num_experts, block_m) // block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    has_counts = counts is not None
    scratch = counts
    if scratch is None:
        scratch = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](
        ids, scratch, sorted_pairs, block_expert, num_pairs, num_blocks,
        NUM_EXPERTS=num_experts, BLOCK_M=block_m, HAS_COUNTS=has_counts,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_P=_ALIGN_CHUNK,
        BLOCK_R=1024, num_warps=8,
        **pdl_launch_kwargs(dev, 1),
    )  # fmt: skip
    return sorted_pairs, block_expert


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    shared_expert: bool = False,
    block_m: int | None = None,
    backend: str = "auto",
    count_in_route: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Layout | None]:
    """(weights, ids int32 on Triton / int64 on torch, layout) of `route_ref`'s routing.

    `count_in_route`: the routing kernel counts pairs per expert with atomics into a zeroed
    buffer (one memset launch more); by default the alignment program counts them itself,
    which at decode sizes costs less than the memset (`bench_moe.py` times both).

    With `block_m`, the Triton path also returns the aligned layout for the expert kernels
    (`fused_moe(..., layout=)`); the torch path and the large-batch case return None, and the
    expert kernel then aligns by itself.
    """
    if logits.dim() != 2:
        raise ValueError(f"moe_route expects logits [T, E], got {tuple(logits.shape)}")
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
    count = align and count_in_route
    counts = torch.zeros(width, dtype=torch.int32, device=dev) if count else None
    _route_kernel[(num_tokens,)](
        logits, ids, weights, ids if counts is None else counts, logits.stride(0),
        NUM_EXPERTS=num_experts, TOP_K=top_k, RENORMALIZE=renormalize,
        SHARED=shared_expert, HAS_COUNTS=count,
        BLOCK_E=triton.next_power_of_2(width), BLOCK_K=triton.next_power_of_2(k_total),
        num_warps=4 if width > 128 else 1, **pdl_launch_kwargs(dev, num_tokens),
    )  # fmt: skip
    if not align:
        return weights, ids, None
    assert block_m is not None
    return weights, ids, moe_align(ids, width, block_m, counts)
