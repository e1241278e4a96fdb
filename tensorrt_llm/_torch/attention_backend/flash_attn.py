"""Optional flash-attn backend (`attn_backend="flash_attn"`): flash-attn's kernels over the
paged KV cache.

Same contract as `VanillaAttention`. A step is handled as
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
from .triton_kernels import store_kv
from .utils import AttentionShape
from .vanilla import VanillaAttention

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


class FlashAttnAttention(AttentionShape):
    """`forward(q: [T, H*D], k: [T, KVH*D], v: [T, KVH*D], attn_metadata) -> [T, H*D]`.

    Rows past `num_ctx_tokens + num_generations` (padding) come back as zeros.
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
        # Without a KV cache there is no paged cache to read; the reference handles that
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
        # NOTE: the same step skeleton as TritonAttention.forward (checks, store, output rows).
        # One shared base is the plan, but the Triton path changes only after a GPU run.
        total = q.shape[0]
        used = md.num_ctx_tokens + md.num_generations
        if used > total or k.shape[0] != total or v.shape[0] != total:
            raise ValueError(
                f"q/k/v have {total}/{k.shape[0]}/{v.shape[0]} rows; the step needs {used}"
            )
        kv_width = self.num_kv_heads * self.head_dim
        if q.shape[-1] != self.num_heads * self.head_dim or k.shape[-1] != kv_width:
            raise ValueError(
                f"q/k widths {q.shape[-1]}/{k.shape[-1]} do not match {self.num_heads} heads, "
                f"{self.num_kv_heads} kv heads of dim {self.head_dim}"
            )
        q3 = q.reshape(total, self.num_heads, self.head_dim)
        k3 = k.reshape(total, self.num_kv_heads, self.head_dim)
        v3 = v.reshape(total, self.num_kv_heads, self.head_dim)
        kv_buffer = manager.get_buffers(self.layer_idx)
        check_flash_attn_cache(kv_buffer, q.dtype)
        stored = min(total, md.slot_mapping.shape[0])
        store_kv(kv_buffer, k3[:stored], v3[:stored], md.slot_mapping[:stored])
        # [blocks, tokens_per_block, kv_heads, D] views, last dim contiguous as flash-attn asks.
        k_cache, v_cache = kv_buffer[:, 0], kv_buffer[:, 1]
        out = torch.empty_like(q3) if used == total else torch.zeros_like(q3)
        if md.num_contexts > 0:
            self._prefill(q3, out, k_cache, v_cache, md)
        if md.num_generations > 0:
            self._decode(q3, out, k_cache, v_cache, md)
        return out.view(total, self.num_heads * self.head_dim)

    __call__ = forward

    def _prefill(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> None:
        n, tokens = md.num_contexts, md.num_ctx_tokens
        kv_lens = md.num_cached_tokens[:n] + md.seq_lens[:n]
        cu_seqlens_k = torch.zeros(n + 1, dtype=torch.int32, device=q.device)
        cu_seqlens_k[1:] = torch.cumsum(kv_lens, 0)
        # Host metadata is fine here: prefill steps are not graph-captured.
        new_cpu = md.seq_lens_cpu[:n]
        out[:tokens] = self._varlen(
            q[:tokens],
            k_cache,
            v_cache,
            md.cu_seqlens_q[: n + 1],
            cu_seqlens_k,
            int(new_cpu.max()),
            int((md.num_cached_tokens_cpu[:n] + new_cpu).max()),
            softmax_scale=self.scale,
            causal=True,
            block_table=md.block_tables[:n],
        )

    def _decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> None:
        first, num_gens = md.num_ctx_tokens, md.num_generations
        rows = slice(md.num_contexts, md.num_contexts + num_gens)
        # The step's token is already stored, so each request attends to cached + 1 keys.
        cache_seqlens = (md.num_cached_tokens[rows] + md.seq_lens[rows]).to(torch.int32)
        step = self._with_kvcache(
            q[first : first + num_gens].unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=cache_seqlens,
            block_table=md.block_tables[rows],
            softmax_scale=self.scale,
            causal=True,
        )
        out[first : first + num_gens] = step.squeeze(1)
