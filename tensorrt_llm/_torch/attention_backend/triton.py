"""Triton attention backend: paged KV store, varlen prefill and split-K decode kernels.

Same contract as `VanillaAttention`; this is the fast path on CUDA. A step is handled as
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
from .triton_kernels import paged_decode, paged_prefill, store_kv
from .triton_kernels.decode import choose_num_splits
from .utils import AttentionShape
from .vanilla import VanillaAttention


class TritonAttention(AttentionShape):
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
        # Without a KV cache there is nothing paged to read; the reference handles that
        # (prefill-only) case.
        self._no_cache = VanillaAttention(num_heads, num_kv_heads, head_dim, layer_idx, scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        manager = md.kv_cache_manager
        if manager is None:
            return self._no_cache.forward(q, k, v, md)
        total = q.shape[0]
        kv_width = self.num_kv_heads * self.head_dim
        if (
            q.shape[-1] != self.num_heads * self.head_dim
            or k.shape[-1] != kv_width
            or (v.shape[-1] != kv_width)
        ):
            raise ValueError(
                f"q/k/v widths {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]} do not match "
                f"{self.num_heads} heads, {self.num_kv_heads} kv heads of dim {self.head_dim}"
            )
        q3 = q.reshape(total, self.num_heads, self.head_dim)
        k3 = k.reshape(k.shape[0], self.num_kv_heads, self.head_dim)
        v3 = v.reshape(v.shape[0], self.num_kv_heads, self.head_dim)
        kv_buffer = manager.get_buffers(self.layer_idx)
        if tuple(kv_buffer.shape[3:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"layer {self.layer_idx} KV buffer {tuple(kv_buffer.shape)} does not hold "
                f"{self.num_kv_heads} kv heads of dim {self.head_dim}"
            )
        used = md.num_ctx_tokens + md.num_generations
        if used > total or k3.shape[0] != total or v3.shape[0] != total:
            raise ValueError(
                f"q/k/v have {total}/{k3.shape[0]}/{v3.shape[0]} rows; the step needs {used}"
            )
        # Shapes only: padded rows carry slot -1 and are skipped inside the kernel.
        stored = min(total, md.slot_mapping.shape[0])
        store_kv(kv_buffer, k3[:stored], v3[:stored], md.slot_mapping[:stored])
        out = torch.empty_like(q3) if used == total else torch.zeros_like(q3)
        if md.num_contexts > 0:
            self._prefill(q3, out, kv_buffer, md)
        if md.num_generations > 0:
            self._decode(q3, out, kv_buffer, md)
        return out.view(total, self.num_heads * self.head_dim)

    __call__ = forward

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
