"""Vanilla attention: the pure-torch reference backend over the paged KV cache (CPU and GPU).

Per request it gathers the cached K/V through its block table and runs SDPA. Each request's
queries sit at absolute positions `num_cached .. num_cached + n - 1`, so a context chunk with a
cached prefix sees the whole prefix plus causal attention over its own tokens, and a
generation token sees everything. It loops over requests in Python, reading host ints from
the `*_cpu` metadata fields only; the fast path is the Triton backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .interface import AttentionMetadata
from .utils import AttentionShape, to_cache_dtype


def store_kv(
    kv_buffer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `k, v: [N, num_kv_heads, head_dim]` into the paged cache at `slot_mapping: [N]`.

    `kv_buffer: [num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]`; slot -1 is skipped.
    """
    num_blocks, _, tokens_per_block, num_kv_heads, head_dim = kv_buffer.shape
    valid = slot_mapping >= 0
    # The boolean mask is a data-dependent shape (a device sync on GPU); acceptable for this
    # reference backend, the Triton store kernel skips -1 in-kernel instead.
    slots = slot_mapping[valid].long()
    blocks = torch.div(slots, tokens_per_block, rounding_mode="floor")
    offsets = slots - blocks * tokens_per_block
    kv_buffer[blocks, 0, offsets] = to_cache_dtype(k[valid], kv_buffer.dtype)
    kv_buffer[blocks, 1, offsets] = to_cache_dtype(v[valid], kv_buffer.dtype)


def gather_kv(
    kv_buffer: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of the first `num_tokens` tokens of one request: each `[num_tokens, kv_heads, D]`."""
    tokens_per_block = kv_buffer.shape[2]
    num_blocks = -(-num_tokens // tokens_per_block)
    blocks = kv_buffer.index_select(0, block_table[:num_blocks].long())
    k = blocks[:, 0].reshape(-1, *kv_buffer.shape[3:])[:num_tokens]
    v = blocks[:, 1].reshape(-1, *kv_buffer.shape[3:])[:num_tokens]
    return k, v


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float
) -> torch.Tensor:
    """`q: [n, H, D]` at positions `num_cached..`; `k, v: [num_cached + n, KVH, D]`.

    Returns `[n, H, D]`.
    """
    n, num_heads, _ = q.shape
    total, num_kv_heads, _ = k.shape
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    qh, kh, vh = (t.transpose(0, 1).to(q.dtype) for t in (q, k, v))  # [heads, len, D]
    if n == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
    elif num_cached == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(n, device=q.device)[:, None] + num_cached
        k_pos = torch.arange(total, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=k_pos <= q_pos, scale=scale)
    return out.transpose(0, 1)


class VanillaAttention(AttentionShape):
    """Reference attention over the packed tokens of one step.

    `forward(q: [T, H*D], k: [T, KVH*D], v: [T, KVH*D], attn_metadata) -> [T, H*D]`. Rows past
    `attn_metadata.num_tokens` (CUDA-graph padding) come back as zeros.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = attn_metadata.num_tokens
        # Views also of strided column slices of a fused qkv output (only the last dim splits).
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        manager = attn_metadata.kv_cache_manager
        kv_buffer = None
        if manager is not None:
            kv_buffer = manager.get_buffers(self.layer_idx)
            store_kv(
                kv_buffer, k[:num_tokens], v[:num_tokens], attn_metadata.slot_mapping[:num_tokens]
            )
        out = torch.zeros_like(q)
        seq_lens = attn_metadata.seq_lens_cpu.tolist()
        cached = attn_metadata.num_cached_tokens_cpu.tolist()
        start = 0
        for b in range(attn_metadata.num_seqs):
            n, past = int(seq_lens[b]), int(cached[b])
            end = start + n
            if kv_buffer is None:
                if past != 0:
                    raise ValueError(
                        f"request {b} has {past} cached tokens but no kv_cache_manager was given"
                    )
                req_k, req_v = k[start:end], v[start:end]
            else:
                req_k, req_v = gather_kv(kv_buffer, attn_metadata.block_tables[b], past + n)
            out[start:end] = causal_attention(q[start:end], req_k, req_v, past, self.scale)
            start = end
        if start != num_tokens:
            raise ValueError(f"seq_lens sum to {start} but attn_metadata.num_tokens={num_tokens}")
        return out.view(-1, self.num_heads * self.head_dim)

    __call__ = forward
