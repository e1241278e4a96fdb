"""Triton attention backend against the vanilla reference: prefill, chunked prefill over a
cached prefix, split-K decode, mixed batches, GQA, padded graph rows and the KV store (the fp8
cache has its own module, test_triton_attention_fp8.py).

On CPU the kernels run under TRITON_INTERPRET=1 at tiny sizes (fp32); GPU-marked tests repeat
the checks at larger sizes in bf16 and capture/replay the decode path in a CUDA graph.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton_pair_helpers import (  # noqa: E402
    HEAD_DIM,
    TPB,
    FakeKVCacheManager,
    build_metadata,
)
from triton_pair_helpers import Pair as _Pair  # noqa: E402
from triton_pair_helpers import qkv_rows as _qkv  # noqa: E402
from triton_pair_helpers import step_rows as _rows  # noqa: E402

from tensorrt_llm._torch.attention_backend import (  # noqa: E402
    VanillaAttention,
    get_attention_backend,
)
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton import TritonAttention  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton_kernels import paged_decode, store_kv  # noqa: E402
from tensorrt_llm._torch.attention_backend.triton_kernels.decode import (  # noqa: E402
    choose_num_splits,
)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_prefill_then_chunked_prefill_and_decode(heads: int, kv_heads: int) -> None:
    pair = _Pair(heads, kv_heads, splits=3)
    pair.step([(0, 21, 0), (1, 7, 0), (2, 10, 0)], [])  # pure prefill, several tiles
    pair.step([(2, 18, 10)], [(0, 21), (1, 7)])  # chunk over a cached prefix + decodes
    pair.step([], [(0, 22), (1, 8), (2, 28)])  # pure decode, split-K


def test_pure_decode_split_counts_and_ragged_lengths() -> None:
    lengths = [1, 5, 13, 34]  # prompt lengths: not multiples of the split or block sizes
    for splits in (1, 2, 5):
        pair = _Pair(2, 1, splits=splits)
        pair.step([(r, n, 0) for r, n in enumerate(lengths)], [])
        for i in range(2):
            pair.step([], [(r, n + i) for r, n in enumerate(lengths)])


def test_heuristic_splits_and_mixed_batch_with_padding() -> None:
    pair = _Pair(4, 1)  # GQA group of 4, heuristic split count
    pair.step([(0, 9, 0), (1, 3, 0)], [])
    got, md = pair.step([(2, 6, 0)], [(0, 9), (1, 3)], pad_to=12)
    assert torch.equal(got[md.num_tokens :], torch.zeros_like(got[md.num_tokens :]))


def test_padded_decode_rows_do_not_crash_or_store() -> None:
    """Graph-bucket padding: extra generation rows with slot -1, seq_len 1, num_cached 0 and
    a block table row pointing at block 0."""
    heads, kv_heads = 2, 2
    pair = _Pair(heads, kv_heads, splits=2)
    pair.step([(0, 11, 0)], [])
    md = build_metadata(pair.tri_cache, [], [(0, 11)])
    pad = 3
    md = _pad_generation_rows(md, pad)
    before = pair.tri_cache.get_buffers(0).clone()
    q, k, v = _qkv([(0, 11, 1)], heads, kv_heads, HEAD_DIM, seed=0)
    q, k, v = (torch.cat([t, torch.randn(pad, t.shape[1])]) for t in (q, k, v))
    out = pair.tri.forward(q, k, v, md)
    ref_md = build_metadata(pair.ref_cache, [], [(0, 11)])
    expected = pair.ref.forward(q[:1], k[:1], v[:1], ref_md)
    torch.testing.assert_close(out[:1], expected, atol=1e-4, rtol=1e-4)
    # The padded rows' output is ignored (here it is NaN: block 0 slot 0 of the fake cache
    # was never written); they only must not crash nor store.
    assert out.shape == q.shape
    changed = (pair.tri_cache.get_buffers(0) != before) & ~torch.isnan(before)
    changed |= torch.isnan(before) & ~torch.isnan(pair.tri_cache.get_buffers(0))
    assert int(changed.any(dim=(-1, -2)).sum()) == 2  # one K and one V slot: the real token


def _pad_generation_rows(md: AttentionMetadata, pad: int) -> AttentionMetadata:
    def cat(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((pad, *t.shape[1:]), value, dtype=t.dtype)])

    tables = cat(md.block_tables, -1)
    tables[-pad:, 0] = 0
    seq_lens = cat(md.seq_lens, 1)
    cached = cat(md.num_cached_tokens, 0)
    cu = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    return AttentionMetadata(
        num_contexts=0,
        num_generations=md.num_generations + pad,
        num_ctx_tokens=0,
        num_tokens=md.num_tokens,
        seq_lens_cpu=seq_lens,
        num_cached_tokens_cpu=cached,
        seq_lens=seq_lens,
        num_cached_tokens=cached,
        cu_seqlens_q=cu,
        block_tables=tables,
        slot_mapping=cat(md.slot_mapping, -1),
        seq_slots=cat(md.seq_slots, 0),
        seq_slots_cpu=cat(md.seq_slots_cpu, 0),
        kv_cache_manager=md.kv_cache_manager,
        tokens_per_block=md.tokens_per_block,
    )


def test_store_kv_skips_minus_one_and_converts_dtype() -> None:
    cache = torch.full((3, 2, TPB, 2, HEAD_DIM), float("nan"), dtype=torch.float64)
    k = torch.randn(5, 2, HEAD_DIM)
    v = torch.randn(5, 2, HEAD_DIM)
    slots = torch.tensor([5, -1, 0, 11, -1], dtype=torch.int64)
    store_kv(cache, k, v, slots)
    for row, slot in ((0, 5), (2, 0), (3, 11)):
        block, off = divmod(slot, TPB)
        torch.testing.assert_close(cache[block, 0, off], k[row].double())
        torch.testing.assert_close(cache[block, 1, off], v[row].double())
    assert int((~torch.isnan(cache[..., 0, 0])).sum()) == 6  # 3 tokens x (K, V)
    with pytest.raises(ValueError, match="slot_mapping has 2 rows"):
        store_kv(cache, k, v, slots[:2])


def test_no_cache_prefill_registry_and_bad_input() -> None:
    heads, kv_heads = 2, 1
    q, k, v = _qkv([(0, 0, 9)], heads, kv_heads, HEAD_DIM, seed=1)
    md = build_metadata(None, [(0, 9, 0)], [])
    tri = get_attention_backend("triton")(heads, kv_heads, HEAD_DIM, 0, HEAD_DIM**-0.5)
    assert isinstance(tri, TritonAttention)
    ref = VanillaAttention(heads, kv_heads, HEAD_DIM, 0)
    torch.testing.assert_close(tri.forward(q, k, v, md), ref.forward(q, k, v, md))
    with pytest.raises(ValueError, match="not divisible"):
        TritonAttention(4, 3, HEAD_DIM, 0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        TritonAttention(2, 1, HEAD_DIM, 0, num_kv_splits=0)
    wrong = build_metadata(FakeKVCacheManager(1, 8, TPB, 2, HEAD_DIM), [(0, 9, 0)], [])
    with pytest.raises(ValueError, match="does not hold"):
        tri.forward(q, k, v, wrong)
    with pytest.raises(ValueError, match="widths"):
        tri.forward(q, k[:, :8], v, wrong)
    md = build_metadata(FakeKVCacheManager(1, 8, TPB, kv_heads, HEAD_DIM), [(0, 9, 0)], [])
    with pytest.raises(ValueError, match="the step needs 9"):
        tri.forward(q[:5], k[:5], v[:5], md)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2), (16, 2), (7, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_gqa_groups_and_head_dims(heads: int, kv_heads: int, head_dim: int) -> None:
    """One program serves a whole query-head group (1, 2, 4, 8 and non-power-of-two 7)."""
    pair = _Pair(heads, kv_heads, head_dim, blocks=16, splits=2)
    pair.step([(0, 3, 0), (1, 19, 0)], [])
    pair.step([], [(0, 3), (1, 19)])


def test_choose_num_splits_and_bad_group() -> None:
    # Few requests get more splits than many; never more than the static length allows.
    assert choose_num_splits(1, 8, 8192) > choose_num_splits(32, 8, 8192) >= 1
    assert choose_num_splits(1, 8, 64) == 1
    assert choose_num_splits(512, 8, 8192) == 1
    q = torch.zeros(1, 3, HEAD_DIM)
    cache = torch.zeros(2, 2, TPB, 2, HEAD_DIM)
    ones = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="not divisible"):
        paged_decode(q, q, cache, torch.zeros(1, 1, dtype=torch.int32), ones, ones, 0, 1.0, 1)


# ---------------------------------------------------------------- GPU (real kernels, bf16)
@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,head_dim",
    [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float32, 128)],
)
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_gpu_schedule_matches_vanilla(
    dtype: torch.dtype, head_dim: int, splits: int | None
) -> None:
    pair = _Pair(8, 2, head_dim, blocks=400, tpb=16, splits=splits, dtype=dtype, device="cuda")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    pair.step([(0, 300, 0), (1, 45, 0), (2, 129, 0)], [], atol=tol)
    pair.step([(2, 200, 129), (3, 64, 0)], [(0, 300), (1, 45)], atol=tol, pad_to=420)
    for i in range(3):
        pair.step([], [(0, 301 + i), (1, 46 + i), (2, 329 + i), (3, 64 + i)], atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32])
def test_gpu_qwen3_vl_decode_matches_vanilla(batch: int) -> None:
    """Qwen3-VL-8B attention dims (32 q / 8 kv heads, D=128, 32-token blocks), 1000-token
    contexts, heuristic splits, bf16."""
    pair = _Pair(32, 8, 128, blocks=batch * 33 + 8, tpb=32, dtype=torch.bfloat16, device="cuda")
    lengths = [1000 - 7 * r for r in range(batch)]
    pair.step([(r, n, 0) for r, n in enumerate(lengths)], [], atol=2e-2)
    for i in range(2):
        pair.step([], [(r, n + i) for r, n in enumerate(lengths)], atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (28, 4)])
def test_gpu_paged_decode_split_counts_agree_with_gather(heads: int, kv_heads: int) -> None:
    """Sanity (no timing): direct `paged_decode` on a random bf16 cache with shuffled blocks;
    every split count matches an fp32 gather-and-softmax reference."""
    head_dim, tpb, batch, width = 128, 32, 4, 40
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(batch * width, 2, tpb, kv_heads, head_dim, generator=gen)
    cache = cache.to(device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(batch * width, generator=gen).view(batch, width).int().cuda()
    lengths = torch.tensor([1, 33, 700, width * tpb - 1], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    scale = head_dim**-0.5
    expected = torch.empty(batch, heads, head_dim, device="cuda")
    for b, n in enumerate(lengths.tolist()):
        flat = cache[tables[b].long()].float()  # [width, 2, tpb, kvh, D]
        k, v = (flat[:, i].reshape(-1, kv_heads, head_dim)[:n] for i in (0, 1))
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        probs = torch.einsum("hd,nhd->hn", q[b].float() * scale, k).softmax(-1)
        expected[b] = torch.einsum("hn,nhd->hd", probs, v)
    ones = torch.ones(batch, dtype=torch.int32, device="cuda")
    for splits in (1, 3, choose_num_splits(batch, kv_heads, width * tpb), 32):
        out = torch.full_like(q, float("nan"))
        paged_decode(q, out, cache, tables, ones, lengths - 1, 0, scale, splits)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def _compiled_variants(kernel: object) -> int:
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
def test_gpu_decode_compiles_once_for_any_batch_split_or_offset() -> None:
    """Mixed steps run decode eagerly with a new row count, split count and request offset
    almost every step; none of them may trigger a recompile (each costs ~0.3 s of serving)."""
    from tensorrt_llm._torch.attention_backend.triton_kernels import decode

    heads, kv_heads, head_dim, tpb, width = 8, 2, 64, 16, 8
    cache = torch.randn(64, 2, tpb, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q_all = torch.randn(40, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(64, dtype=torch.int32, device="cuda").view(8, width).repeat(5, 1)
    ones = torch.ones(40, dtype=torch.int32, device="cuda")
    cached = torch.full((40,), 50, dtype=torch.int32, device="cuda")

    def run(rows: int, offset: int, splits: int) -> None:
        q = q_all[offset : offset + rows]
        decode.paged_decode(
            q, torch.empty_like(q), cache, tables, ones, cached, offset, 0.1, splits
        )

    run(3, 0, 2)
    run(2, 0, 1)
    split_kernels = _compiled_variants(decode._decode_split_kernel)
    reduce_kernels = _compiled_variants(decode._decode_reduce_kernel)
    for rows, offset, splits in [(1, 1, 2), (16, 16, 5), (17, 3, 32), (32, 0, 7), (5, 32, 1)]:
        run(rows, offset, splits)
    torch.cuda.synchronize()
    assert _compiled_variants(decode._decode_split_kernel) == split_kernels
    assert _compiled_variants(decode._decode_reduce_kernel) == reduce_kernels


def _copy_step(static: AttentionMetadata, md: AttentionMetadata) -> None:
    """Write a live step's device metadata into the captured buffers (padded rows keep
    slot -1, seq_len 1, num_cached 0 and block 0)."""
    g = md.num_generations
    static.seq_lens[:g].copy_(md.seq_lens)
    static.num_cached_tokens[:g].copy_(md.num_cached_tokens)
    static.block_tables[:g].fill_(-1)
    static.block_tables[:g, : md.block_tables.shape[1]].copy_(md.block_tables)
    static.slot_mapping[:g].copy_(md.slot_mapping[:g])


# (device, heads, kv_heads, head_dim, tokens_per_block, dtype, prompt lengths, table width)
_GRAPH_CASES = {
    "cpu": ("cpu", 2, 1, HEAD_DIM, TPB, torch.float32, [10, 3, 25], 12),
    "cuda": ("cuda", 8, 2, 128, 16, torch.bfloat16, [100, 37, 250], 32),
}


@pytest.mark.parametrize(
    "case,splits",
    [("cpu", 3), pytest.param("cuda", None, marks=pytest.mark.gpu)]
    + [pytest.param("cuda", 4, marks=pytest.mark.gpu)],
)
def test_decode_static_buffers_replay_with_new_inputs(case: str, splits: int | None) -> None:
    """Decode through persistent, padded buffers whose contents change step after step; on
    CUDA the forward is captured once in a graph and replayed."""
    device, heads, kv_heads, head_dim, tpb, dtype, lengths, width = _GRAPH_CASES[case]
    pair = _Pair(heads, kv_heads, head_dim, 200, tpb, splits, dtype, device)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    pair.step([(r, n, 0) for r, n in enumerate(lengths)], [], atol=tol)
    real, pad = len(lengths), 2
    static = _pad_generation_rows(build_metadata(pair.tri_cache, [], list(enumerate(lengths))), pad)
    tables = torch.full((real + pad, width), -1, dtype=torch.int32)  # static width
    tables[:, : static.block_tables.shape[1]] = static.block_tables
    static.block_tables = tables
    for name in ("seq_lens", "num_cached_tokens", "cu_seqlens_q", "block_tables", "slot_mapping"):
        setattr(static, name, getattr(static, name).to(device))
    q_s, k_s, v_s = (
        torch.zeros(real + pad, w * head_dim, dtype=dtype, device=device)
        for w in (heads, kv_heads, kv_heads)
    )
    run = _capture(pair.tri, q_s, k_s, v_s, static) if device == "cuda" else None
    for step in range(3):
        gen = [(r, n + step) for r, n in enumerate(lengths)]
        md_tri = build_metadata(pair.tri_cache, [], gen, device=device)
        md_ref = build_metadata(pair.ref_cache, [], gen, device=device)
        q, k, v = _qkv(_rows([], gen), heads, kv_heads, head_dim, 0, dtype, device)
        _copy_step(static, md_tri)
        for dst, src in ((q_s, q), (k_s, k), (v_s, v)):
            dst[:real].copy_(src)
            dst[real:].normal_()
        out_s = run() if run is not None else pair.tri.forward(q_s, k_s, v_s, static)
        expected = pair.ref.forward(q, k, v, md_ref)
        torch.testing.assert_close(out_s[:real].float(), expected.float(), atol=tol, rtol=tol)


def _capture(
    attn: TritonAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    md: AttentionMetadata,
) -> Callable[[], torch.Tensor]:
    """Capture `attn.forward` on static inputs; returns a function that replays the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        attn.forward(q, k, v, md)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward(q, k, v, md)

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def test_block_table_width_compiles_no_variant_of_its_own() -> None:
    # The MTP head's block tables are as wide as its step's longest row, so their stride
    # takes every value; Triton specialises an int argument equal to 1 or divisible by 16
    # unless told not to, which compiled new kernel variants inside served MTP steps (the
    # warm-up's steps had other widths).
    from tensorrt_llm._torch.attention_backend.triton_kernels import decode, prefill

    for kernel in (prefill._prefill_kernel, decode._decode_split_kernel):
        # Under the interpreter the decorator's arguments sit in `kwargs`; Triton keeps the
        # names given, or their positions, by version.
        given = getattr(kernel, "do_not_specialize", None)
        if given is None:
            given = kernel.kwargs.get("do_not_specialize", ())
        unspecialized = {kernel.arg_names[i] if isinstance(i, int) else i for i in given}
        assert "stride_bt" in unspecialized, kernel.fn.__name__
