"""A stand-in for the flash-attn package, for testing the flash_attn backend where the package
is not installed (neither of this project's machines has it).

It implements the two entry points the backend calls, in plain torch, from flash-attn's
documented contract (flash_attn_interface.py docstrings): paged K/V caches
`[num_blocks, page_block_size, kv_heads, D]` with `page_block_size` a multiple of 256, int32
`cu_seqlens`/`cache_seqlens`/`block_table`, fp16/bf16 inputs with the cache in the same dtype, a
contiguous last dimension, GQA by head groups, and a causal mask aligned to the bottom-right
corner (query i of Lq attends to keys j <= i + Lk - Lq). Every rule is asserted, so a caller
that breaks one fails here as it would fail in the real kernels.
"""

from __future__ import annotations

import torch

_PAGE_MULTIPLE = 256
_DTYPES = (torch.float16, torch.bfloat16)


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert q.dtype in _DTYPES, f"FlashAttention only supports fp16 and bf16, got {q.dtype}"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q, k, v dtypes differ"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "last dim must be contiguous"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert k_cache.shape[1] % _PAGE_MULTIPLE == 0, "page_block_size must be a multiple of 256"
    assert q.shape[-2] % k_cache.shape[2] == 0, "heads must be a multiple of kv heads"


def _paged(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    assert table_row.dtype == torch.int32, "block_table must be int32"
    page = cache.shape[1]
    blocks = table_row[: -(-length // page)].tolist()
    assert all(b >= 0 for b in blocks), f"block table reads an unset entry: {blocks}"
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """`q: [Lq, H, D]`, `k, v: [Lk, KVH, D]` -> `[Lq, H, D]`, in fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row gives zeros
    return torch.einsum("hqk,khd->qhd", probs, v)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    assert block_table is not None, "the stand-in covers the paged form only"
    _check_cache(q, k, v)
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    batch = cu_seqlens_q.numel() - 1
    assert cu_seqlens_k.numel() == batch + 1 and block_table.shape[0] == batch
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert cq[-1] == q.shape[0], "cu_seqlens_q must cover every query row"
    out = torch.empty_like(q)
    for b in range(batch):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        assert lq <= max_seqlen_q and lk <= max_seqlen_k, "max_seqlen below a sequence length"
        keys = _paged(k, block_table[b], lk)
        values = _paged(v, block_table[b], lk)
        rows = q[cq[b] : cq[b + 1]]
        out[cq[b] : cq[b + 1]] = _attend(rows, keys, values, scale, causal).to(q.dtype)
    return out


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    assert block_table is not None and k is None and v is None, "stand-in: paged, no append"
    _check_cache(q, k_cache, v_cache)
    assert q.dim() == 4, "q must be [batch, seqlen, heads, D]"
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    for b, length in enumerate(cache_seqlens.tolist()):
        keys = _paged(k_cache, block_table[b], length)
        values = _paged(v_cache, block_table[b], length)
        out[b] = _attend(q[b], keys, values, scale, causal).to(q.dtype)
    return out
