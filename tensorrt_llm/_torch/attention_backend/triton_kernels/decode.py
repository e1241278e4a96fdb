"""Paged decode (flash-decoding): one query per generation request, split-K over the KV length.

Kernel 1 runs grid (num_generations, num_kv_heads, num_splits): each program serves all GROUP
query heads that share one KV head, so every K/V row is read from HBM once per split rather
than once per query head. The group is padded to >= 16 rows so the two products (q @ k^T and
p @ v) run on tensor cores through `tl.dot`. Each program walks its share of the request's
`num_cached + seq_len` tokens through the block table with an online softmax. With one split
it writes the output directly; otherwise it writes unnormalised partials (acc, max, sum) per
query head and kernel 2 merges the splits.
NOTE: CUDA-graph safe. Lengths and block ids are read on the device; the host only supplies
shapes and the constant `num_splits`, so a captured launch stays valid for new lengths.
`num_splits` and the request offset are plain runtime integers (not constexpr, not
specialised): the split count follows the batch size, and a kernel variant per batch size
would mean compiles in the middle of serving whenever a mixed step has a new size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...modules.triton_kernels import pdl_launch_kwargs, pdl_sync

_LOG2E = 1.4426950408889634
# Fewest keys (of the static bound) worth a split of their own, and the cap on splits.
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 32
# Reduce tile: one power of two covering any split count, so the reduce kernel compiles once.
_BLOCK_SPLITS = triton.next_power_of_2(_MAX_SPLITS)
# Programs for ~2 waves of an H200 (132 SMs); each program streams one KV head's tiles. More
# splits than that only add partial traffic: at batch 32 x 8 KV heads one split beat three
# by 25% (benchmarks/tune_decode.py, results in benchmarks/results/decode_tiles_h200.md).
_TARGET_PROGRAMS = 256
# Smallest tile `tl.dot` accepts along any dimension.
_MIN_DOT = 16
# Bytes of one K (or V) tile and the most keys per tile: 128 keys of head dim 128 in bf16 or
# fp8, 64 keys of head dim 256 in bf16. Measured best on the H200 with 3 pipeline stages.
_TILE_BYTES = 32768
_MAX_BLOCK_N = 128


# NOTE: `stride_bt` (the block table's width) is a runtime value: callers pass tables as wide
# as their step's longest row (the MTP head's), and a width of 1 or a multiple of 16 would
# each compile a variant of their own inside a served step.
@triton.jit(do_not_specialize=["req_offset", "num_splits", "stride_bt"])
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
    num_splits,
    TOKENS_PER_BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F16: tl.constexpr,
    QK_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    req = (req_offset + row).to(tl.int64)
    kv_len = tl.load(num_cached_ptr + req) + tl.load(seq_lens_ptr + req)
    # Splits cover whole BLOCK_N tiles, so only a split's last tile is ragged.
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    rows = tl.arange(0, GROUP_P)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dmask[None, :]
    q_offs = row * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    # Padding rows are zero: finite scores, never stored. K/V are converted to the dot dtype
    # after loading, so an fp8 cache is read at half the bytes. With DOT_F16 (fp8 caches) the
    # products run in fp16: e4m3 -> fp16 is exact, and it measured 25% faster than converting
    # to bf16 on the H200; q is clamped to fp16's range first (q is normed, so the clamp does
    # not bite in practice).
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    if DOT_F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    # QK_FP8 (fp8 caches, experimental): q is quantised to e4m3 with one scale per head, so
    # q @ k^T multiplies the cache's fp8 K as loaded; p @ v stays in fp16 (DOT_F16).
    score_scale = tl.zeros([GROUP_P], tl.float32) + qk_scale
    if QK_FP8:
        q32 = q.to(tl.float32)
        q_scale = tl.maximum(tl.max(tl.abs(q32), 1) / 448.0, 1e-12)
        q_dot = (q32 / q_scale[:, None]).to(cache_ptr.dtype.element_ty)
        score_scale = q_scale * qk_scale
    else:
        q_dot = q
    table = block_tables_ptr + req * stride_bt
    kv_base = cache_ptr + kv_head * stride_ch
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    # An empty split (start >= end) skips the loop and reports max -inf, sum 0.
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end
        # Clamp: a padded graph row may carry -1 table entries; block 0 is always addressable.
        block = tl.load(table + offs_n // TOKENS_PER_BLOCK, mask=key_ok, other=0)
        block = tl.maximum(block, 0).to(tl.int64)
        tok = block * stride_cb + (offs_n % TOKENS_PER_BLOCK) * stride_ct
        kv_offs = tok[:, None] + dims[None, :]
        kv_mask = key_ok[:, None] & dmask[None, :]
        k = tl.load(kv_base + kv_offs, mask=kv_mask, other=0.0).to(q_dot.dtype)
        s = tl.dot(q_dot, tl.trans(k), input_precision=DOT_PRECISION) * score_scale[:, None]
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_base + stride_ckv + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    if not SPLIT:
        out = acc / l_i[:, None]
        out_offs = row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (row * num_heads + heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    part = (row * num_heads + head) * num_splits + splits
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


def choose_num_splits(num_generations: int, num_kv_heads: int, max_kv_len: int) -> int:
    """Host-only split count: enough (request, kv head, split) programs to fill the GPU, never
    splits shorter than `_MIN_TOKENS_PER_SPLIT` of the longest possible context (`max_kv_len`
    is a static bound, not a live length, so a CUDA graph captured with it stays valid).
    Few requests get many splits (latency); large batches get few (less merge traffic)."""
    by_length = triton.cdiv(max(max_kv_len, 1), _MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, max(num_generations * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape of the split kernel: head-dim tile, keys per tile, pipeline stages, warps."""

    block_d: int
    block_n: int
    num_stages: int
    num_warps: int
    # fp8 caches only: q @ k^T and p @ v in fp16 instead of q's dtype.
    fp16_dot: bool = False
    # fp8 caches only, experimental (tune_decode.py): q @ k^T in e4m3 with a per-head q scale;
    # p @ v in fp16.
    qk_fp8: bool = False


def _tile_config(head_dim: int, dtype: torch.dtype, on_gpu: bool) -> DecodeTiles:
    """Tiles of at most `_TILE_BYTES` on the GPU (at most `_MAX_BLOCK_N` keys); the smallest
    legal tiles under the interpreter, where cost scales with tile size."""
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    if not on_gpu:
        return DecodeTiles(block_d, _MIN_DOT, 1, 4)
    elem = dtype.itemsize
    block_n = max(_MIN_DOT, min(_MAX_BLOCK_N, _TILE_BYTES // (block_d * elem)))
    # fp16 products for fp8 caches: 46 vs 63 us per layer at batch 32 (tune_decode.py).
    return DecodeTiles(block_d, block_n, 3, 4, fp16_dot=dtype == torch.float8_e4m3fn)


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
    `num_cached_tokens[b] + seq_lens[b]` tokens through `block_tables[b]`. Query head h reads
    KV head `h // (H // KVH)`; any group size works (it is padded to a power of two >= 16).
    """
    num_gens, num_heads, head_dim = q.shape
    if num_gens == 0:
        return
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")
    num_kv_heads = kv_buffer.shape[3]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or kv_buffer.stride(-1) != 1:
        raise ValueError("q, out and kv_buffer must be contiguous in their last dimension")
    group = num_heads // num_kv_heads
    tiles = _tile_config(head_dim, kv_buffer.dtype, q.is_cuda)
    block_d = tiles.block_d
    part_acc = part_ml = out  # placeholders; unused when num_splits == 1
    if num_splits > 1:
        part_acc = torch.empty(
            (num_gens, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            (num_gens, num_heads, num_splits, 2), dtype=torch.float32, device=q.device
        )
    _decode_split_kernel[(num_gens, num_kv_heads, num_splits)](
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
        num_splits,
        TOKENS_PER_BLOCK=kv_buffer.shape[2],
        GROUP=group,
        GROUP_P=max(_MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=tiles.block_n,
        SPLIT=num_splits > 1,
        # fp32 caches keep exact products (tf32 would cost ~1e-3 of parity).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F16=(tiles.fp16_dot or tiles.qk_fp8) and kv_buffer.dtype == torch.float8_e4m3fn,
        QK_FP8=tiles.qk_fp8 and kv_buffer.dtype == torch.float8_e4m3fn,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **pdl_launch_kwargs(q.device, num_gens * num_kv_heads * num_splits),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_gens, num_heads)](
            out,
            part_acc,
            part_ml,
            out.stride(0),
            out.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=_BLOCK_SPLITS,
            **pdl_launch_kwargs(q.device, num_gens * num_heads),
        )
