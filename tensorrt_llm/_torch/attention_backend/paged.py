"""The step skeleton shared by the paged-cache backends (`triton`, `flash_attn`).

A step: validate the q/k/v widths against the layer's heads, store the step's K/V into the
layer's paged cache (the Triton store kernel; slot -1 rows skipped), then run the context rows
(`_prefill`) and the generation rows (`_decode`) into one output. Rows past
`num_ctx_tokens + num_generations` (CUDA-graph padding) come back as zeros. Without a KV cache
(prefill-only use) the torch reference runs instead.
"""

from __future__ import annotations

import torch

from .interface import AttentionMetadata
from .triton_kernels import store_kv
from .utils import AttentionShape
from .vanilla import VanillaAttention


class PagedAttention(AttentionShape):
    """`forward(q: [T, H*D], k: [T, KVH*D], v: [T, KVH*D], attn_metadata) -> [T, H*D]`.

    Subclasses implement `_prefill` and `_decode` (each writes its rows of `out: [T, H, D]`
    from `q: [T, H, D]` and the cache `[blocks, 2, tokens_per_block, KVH, D]`) and may refuse
    a cache in `_check_cache`.
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
        self._check_cache(kv_buffer, q.dtype)
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

    def _check_cache(self, kv_buffer: torch.Tensor, query_dtype: torch.dtype) -> None:
        """Raise if this backend cannot read `kv_buffer` with queries of `query_dtype`."""

    def _prefill(
        self, q: torch.Tensor, out: torch.Tensor, kv_buffer: torch.Tensor, md: AttentionMetadata
    ) -> None:
        raise NotImplementedError

    def _decode(
        self, q: torch.Tensor, out: torch.Tensor, kv_buffer: torch.Tensor, md: AttentionMetadata
    ) -> None:
        raise NotImplementedError
