"""Triton attention backend: paged KV store, varlen prefill and split-K decode kernels.

Same contract as `VanillaAttention`; this is the fast path on CUDA. A step (the `PagedAttention`
skeleton in paged.py) is handled as
1. store the step's K/V into the layer's paged cache (slot -1 rows skipped in-kernel);
2. context requests (rows `:num_ctx_tokens`): causal prefill over cached prefix + new tokens;
3. generation requests (the next `num_generations` rows): flash-decoding.
NOTE: the generation path reads only host ints (`num_contexts`, `num_ctx_tokens`,
`num_generations`) and tensor shapes, never device values or other `*_cpu` fields, so it can
be captured in a CUDA graph and replayed with new lengths and block tables. A graph runner
that pads the batch counts the padded rows in `num_generations` and gives them slot -1,
seq_len 1, num_cached 0 and a block table row whose first entry is a valid block.
"""

from __future__ import annotations

import torch

from .interface import AttentionMetadata
from .paged import PagedAttention
from .triton_kernels import paged_decode, paged_prefill
from .triton_kernels.decode import choose_num_splits


class TritonAttention(PagedAttention):
    """`forward(q: [T, H*D], k: [T, KVH*D], v: [T, KVH*D], attn_metadata) -> [T, H*D]`.

    Rows past `num_ctx_tokens + num_generations` (padding) come back as zeros.
    `num_kv_splits` (None = heuristic) fixes the decode split count, for tests and tuning.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        scale: float | None = None,
        num_kv_splits: int | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, layer_idx, scale)
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits

    def _prefill(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        kv_buffer: torch.Tensor,
        md: AttentionMetadata,
    ) -> None:
        # Host metadata is fine here: prefill steps are not graph-captured.
        max_new_tokens = int(md.seq_lens_cpu[: md.num_contexts].max())
        paged_prefill(
            q,
            out,
            kv_buffer,
            md.block_tables,
            md.seq_lens,
            md.num_cached_tokens,
            md.cu_seqlens_q,
            md.num_contexts,
            max_new_tokens,
            self.scale,
        )

    def _decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        kv_buffer: torch.Tensor,
        md: AttentionMetadata,
    ) -> None:
        first, num_gens = md.num_ctx_tokens, md.num_generations
        num_splits = self.num_kv_splits
        if num_splits is None:
            # A static bound (table width), not the live lengths: graph-capture safe.
            max_kv_len = md.block_tables.shape[1] * kv_buffer.shape[2]
            num_splits = choose_num_splits(num_gens, self.num_kv_heads, max_kv_len)
        paged_decode(
            q[first : first + num_gens],
            out[first : first + num_gens],
            kv_buffer,
            md.block_tables,
            md.seq_lens,
            md.num_cached_tokens,
            md.num_contexts,
            self.scale,
            num_splits,
        )
