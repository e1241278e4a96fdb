"""Optional flash-attn backend (`attn_backend="flash_attn"`): flash-attn's kernels over the
paged KV cache.

Same contract as `VanillaAttention`, and `TritonAttention`'s step (width checks, padded rows as
zeros), which it subclasses; only the attention kernels differ:
1. store the step's K/V into the layer's paged cache (the Triton store kernel, slot -1 skipped);
2. context requests: `flash_attn_varlen_func` over the paged cache, causal with the mask
   aligned to the end of each request's keys, so a chunk sees its cached prefix;
3. generation requests: `flash_attn_with_kvcache`, one query row per request.
The generation path reads device tensors and host ints only, so decode CUDA graphs capture it.

flash-attn's rules, checked up front rather than left to fail inside its kernels: CUDA, fp16 or
bf16 queries with a KV cache of the same dtype (no fp8 cache), and a page (`tokens_per_block`)
that is a multiple of 256.

NOTE: flash-attn is installed on neither of this project's machines (no wheel for their
torch/CUDA builds). The backend is tested against a stand-in that follows flash-attn's documented
contract (tests/unittest/_torch/attention_backend/fake_flash_attn.py); a GPU test runs the real
package where it imports. The measured Triton backend stays the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .interface import FLASH_ATTN_PAGE_MULTIPLE, AttentionMetadata
from .triton import TritonAttention

FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


def load_flash_attn() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """flash-attn's `(flash_attn_varlen_func, flash_attn_with_kvcache)`, or a clear error."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError as e:
        raise ValueError(
            "attn_backend 'flash_attn' needs the flash-attn package (pip install flash-attn), "
            f"which does not import here: {e}"
        ) from e
    return flash_attn_varlen_func, flash_attn_with_kvcache


def check_flash_attn_cache(kv_buffer: torch.Tensor, query_dtype: torch.dtype) -> None:
    """Raise unless flash-attn can read `kv_buffer` with queries of `query_dtype`."""
    if query_dtype not in FLASH_ATTN_DTYPES:
        raise ValueError(f"attn_backend 'flash_attn' runs fp16/bf16 models, got {query_dtype}")
    if kv_buffer.dtype != query_dtype:
        raise ValueError(
            f"attn_backend 'flash_attn' needs a {query_dtype} KV cache like the model, got "
            f"{kv_buffer.dtype} (flash-attn has no fp8 cache: use kv_cache_dtype='auto')"
        )
    page = kv_buffer.shape[2]
    if page % FLASH_ATTN_PAGE_MULTIPLE:
        raise ValueError(
            f"attn_backend 'flash_attn' needs tokens_per_block to be a multiple of "
            f"{FLASH_ATTN_PAGE_MULTIPLE} (flash-attn's paged KV page size), got {page}"
        )


class FlashAttnAttention(TritonAttention):
    """`forward(q: [T, H*D], k: [T, KVH*D], v: [T, KVH*D], attn_metadata) -> [T, H*D]`.

    The Triton backend's step (width checks, the KV store kernel, padded rows as zeros) with
    flash-attn's kernels for the context and generation rows (`_prefill`, `_decode`).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        scale: float | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, layer_idx, scale)
        # Resolved at construction, so a missing package fails when the model is built.
        self._varlen, self._with_kvcache = load_flash_attn()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        manager = attn_metadata.kv_cache_manager
        if manager is not None:
            # Before anything is stored: flash-attn's rules, not a failure inside its kernels.
            check_flash_attn_cache(manager.get_buffers(self.layer_idx), q.dtype)
        return super().forward(q, k, v, attn_metadata)

    __call__ = forward

    def _prefill(
        self, q: torch.Tensor, out: torch.Tensor, kv_buffer: torch.Tensor, md: AttentionMetadata
    ) -> None:
        n, tokens = md.num_contexts, md.num_ctx_tokens
        kv_lens = md.num_cached_tokens[:n] + md.seq_lens[:n]
        cu_seqlens_k = torch.zeros(n + 1, dtype=torch.int32, device=q.device)
        cu_seqlens_k[1:] = torch.cumsum(kv_lens, 0)
        # Host metadata is fine here: prefill steps are not graph-captured.
        new_cpu = md.seq_lens_cpu[:n]
        # [blocks, tokens_per_block, kv_heads, D] views, last dim contiguous as flash-attn asks.
        out[:tokens] = self._varlen(
            q[:tokens],
            kv_buffer[:, 0],
            kv_buffer[:, 1],
            md.cu_seqlens_q[: n + 1],
            cu_seqlens_k,
            int(new_cpu.max()),
            int((md.num_cached_tokens_cpu[:n] + new_cpu).max()),
            softmax_scale=self.scale,
            causal=True,
            block_table=md.block_tables[:n],
        )

    def _decode(
        self, q: torch.Tensor, out: torch.Tensor, kv_buffer: torch.Tensor, md: AttentionMetadata
    ) -> None:
        first, num_gens = md.num_ctx_tokens, md.num_generations
        rows = slice(md.num_contexts, md.num_contexts + num_gens)
        # The step's token is already stored, so each request attends to cached + 1 keys.
        cache_seqlens = md.num_cached_tokens[rows] + md.seq_lens[rows]
        step = self._with_kvcache(
            q[first : first + num_gens].unsqueeze(1),
            kv_buffer[:, 0],
            kv_buffer[:, 1],
            cache_seqlens=cache_seqlens,
            block_table=md.block_tables[rows],
            softmax_scale=self.scale,
            causal=True,
        )
        out[first : first + num_gens] = step.squeeze(1)
