"""Packed variable-length (varlen) self-attention for vision towers.

All patches of a batch live in one packed `[N, ...]` tensor; `cu_seqlens` cuts it into segments
(one image, one video frame, or one attention window) and attention never crosses a segment.
Backends:
- `sdpa`: torch reference; one SDPA call per run of equal-length consecutive segments (video
  frames and same-size images batch together), driven by host-side lengths, so no host sync.
- `mask`: one SDPA call with a block-diagonal mask; O(N^2) memory, a reference for tests.
- `flash_attn`: `flash_attn_varlen_func` when the optional flash-attn package is installed.
- `torch_varlen`: `torch.nn.attention.varlen.varlen_attn` when this torch build has it.
- `auto`: on CUDA with fp16/bf16, flash_attn, then torch_varlen, then sdpa; elsewhere sdpa.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

VISION_ATTN_BACKENDS = ("auto", "sdpa", "mask", "flash_attn", "torch_varlen")

try:  # optional accelerator
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except ImportError:  # pragma: no cover - depends on the environment
    _flash_varlen = None

try:
    from torch.nn.attention.varlen import varlen_attn as _torch_varlen
except ImportError:  # pragma: no cover - older torch
    _torch_varlen = None

# Set to False after the first torch varlen failure so later calls skip the probe.
_torch_varlen_ok: bool = _torch_varlen is not None


@dataclass(frozen=True)
class VarlenSegments:
    """Segment layout of one packed batch.

    `cu_seqlens` is int32 `[S+1]` on the compute device (for varlen kernels); the host fields are
    plain Python values so the torch path never reads the device.
    """

    cu_seqlens: torch.Tensor
    seqlens: tuple[int, ...]
    max_seqlen: int
    # (start, segment_length, num_segments) for each run of equal-length consecutive segments.
    runs: tuple[tuple[int, int, int], ...]

    @staticmethod
    def host_cu_seqlens(seqlens: Sequence[int]) -> torch.Tensor:
        """int32 `[S+1]` cumulative lengths on the host."""
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(list(seqlens), dtype=torch.int64).cumsum(0)
        return cu

    @classmethod
    def from_seqlens(
        cls, seqlens: Sequence[int], cu_seqlens: torch.Tensor | None = None
    ) -> VarlenSegments:
        """Build from host lengths; `cu_seqlens` is the device copy (built here on CPU if None)."""
        lens = tuple(int(n) for n in seqlens)
        if not lens or min(lens) <= 0:
            raise ValueError(f"segment lengths must be positive and non-empty, got {lens[:8]}")
        if cu_seqlens is None:
            cu_seqlens = cls.host_cu_seqlens(lens)
        if cu_seqlens.numel() != len(lens) + 1:
            raise ValueError(
                f"cu_seqlens has {cu_seqlens.numel()} entries for {len(lens)} segments"
            )
        runs: list[list[int]] = []
        start = 0
        for n in lens:
            if runs and runs[-1][1] == n:
                runs[-1][2] += 1
            else:
                runs.append([start, n, 1])
            start += n
        return cls(cu_seqlens, lens, max(lens), tuple((s, n, c) for s, n, c in runs))

    @property
    def total(self) -> int:
        return sum(self.seqlens)


def _sdpa_runs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: VarlenSegments
) -> torch.Tensor:
    out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    for start, length, count in seg.runs:
        end = start + length * count
        # A run of equal-length segments is one SDPA batch: [count, heads, length, dim].
        qb, kb, vb = (
            x[start:end].view(count, length, heads, dim).transpose(1, 2) for x in (q, k, v)
        )
        o = F.scaled_dot_product_attention(qb, kb, vb)
        out[start:end] = o.transpose(1, 2).reshape(length * count, heads, dim)
    return out


def _sdpa_mask(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: VarlenSegments
) -> torch.Tensor:
    lens = torch.tensor(seg.seqlens, device=q.device)
    seg_id = torch.repeat_interleave(torch.arange(len(seg.seqlens), device=q.device), lens)
    mask = seg_id[:, None] == seg_id[None, :]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask
    )
    return o[0].transpose(0, 1)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: VarlenSegments) -> torch.Tensor:
    if _flash_varlen is None:
        raise ValueError("vision attention backend 'flash_attn' needs the flash-attn package")
    cu, m = seg.cu_seqlens, seg.max_seqlen
    return _flash_varlen(q, k, v, cu, cu, m, m, dropout_p=0.0, causal=False)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: VarlenSegments) -> torch.Tensor:
    if _torch_varlen is None:
        raise ValueError("vision attention backend 'torch_varlen' needs torch.nn.attention.varlen")
    cu, m = seg.cu_seqlens, seg.max_seqlen
    # NOTE: the default softmax scale (head_dim ** -0.5) is the vision towers' scale.
    return _torch_varlen(q, k, v, cu, cu, m, m)


def _auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: VarlenSegments) -> torch.Tensor:
    global _torch_varlen_ok
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return _sdpa_runs(q, k, v, seg)
    if _flash_varlen is not None:
        return _flash(q, k, v, seg)
    if _torch_varlen_ok:
        try:
            return _varlen(q, k, v, seg)
        except (RuntimeError, NotImplementedError, TypeError) as err:
            # Some builds ship the API without a kernel for this GPU/shape: fall back once, loudly.
            _torch_varlen_ok = False
            logger.warning("torch varlen attention unavailable (%s); using SDPA per segment", err)
    return _sdpa_runs(q, k, v, seg)


_BACKEND_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "auto": _auto,
    "sdpa": _sdpa_runs,
    "mask": _sdpa_mask,
    "flash_attn": _flash,
    "torch_varlen": _varlen,
}


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: VarlenSegments,
    backend: str = "auto",
) -> torch.Tensor:
    """Non-causal attention inside each segment. q, k, v: `[N, heads, head_dim]` -> same shape."""
    if q.shape[0] != segments.total:
        raise ValueError(f"packed length {q.shape[0]} != sum of segment lengths {segments.total}")
    fn = _BACKEND_FNS.get(backend)
    if fn is None:
        raise ValueError(
            f"unknown vision attention backend {backend!r}; one of {VISION_ATTN_BACKENDS}"
        )
    return fn(q, k, v, segments)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_vision_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q, k `[N, heads, head_dim]` by cos/sin `[N, head_dim]` (fp32 math, like HF)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    qf, kf = q.float(), k.float()
    q_out = qf * cos + _rotate_half(qf) * sin
    k_out = kf * cos + _rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


class VisionAttention(nn.Module):
    """Fused-qkv vision self-attention (HF names `qkv`, `proj`) over packed segments."""

    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype, backend: str = "auto") -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"vision hidden size {dim} is not divisible by num_heads {num_heads}")
        if backend not in VISION_ATTN_BACKENDS:
            raise ValueError(f"unknown vision attention backend {backend!r}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.backend = backend
        self.qkv = nn.Linear(dim, 3 * dim, bias=True, dtype=dtype)
        self.proj = nn.Linear(dim, dim, bias=True, dtype=dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: VarlenSegments,
    ) -> torch.Tensor:
        n = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_vision_rotary(q, k, cos, sin)
        out = varlen_attention(q, k, v.contiguous(), segments, self.backend)
        return self.proj(out.reshape(n, -1))
