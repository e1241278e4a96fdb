"""Fused (m)RoPE: cos/sin table lookup per channel axis plus neox rotation of q and k, in place.

Same math as `RotaryEmbedding.get_cos_sin` / `MRotaryEmbedding.get_cos_sin` followed by
`apply_rotary_emb` (rotary_embedding.py), without materialising the `[T, rotary_dim]` cos/sin.
Frequency j of token t reads table row `position_ids[axis[j], t]` (axis from `mrope_channel_axes`:
contiguous sections for Qwen2/2.5-VL, interleaved for Qwen3-VL/3.5) and rotates channels
(j, j + rotary_dim // 2) of every head; channels past `rotary_dim` are untouched (partial rotary).

Optionally the per-head RMSNorm of q and k (Qwen3 / Qwen3.5 `q_norm`, `k_norm`) runs in the same
kernel, before the rotation: one launch instead of three per attention layer, with the rounding
of `rms_norm` (the normalised values are rounded to the input dtype before they are rotated,
exactly as when the norm's output tensor is stored and re-read).

Out-of-range positions: clamped into `[0, max_positions)` and, when an `error_flag` int32 `[1]`
tensor is given, flagged by writing 1 to it. This keeps the kernel free of host syncs and device
asserts (which would kill the CUDA context); the caller checks the flag at a point where it
syncs anyway. Both backends behave the same way.
"""

from __future__ import annotations

import torch

from ..rotary_embedding import apply_rotary_emb
from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton
from .rms_norm import kernel_unsupported_reason as _norm_kernel_rejects
from .rms_norm import rms_norm, rms_norm_torch

_MAX_BLOCK_HEADS = 16


@triton_jit
def _normed(x, rstd, w, ZERO_CENTERED: tl.constexpr, OUT_TY: tl.constexpr):
    """RMSNorm of float32 `x` rows given their `rstd`, rounded as `rms_norm` stores it."""
    n = x * rstd[:, None]
    if ZERO_CENTERED:
        y = n * (1.0 + w[None, :])
    else:
        y = n.to(OUT_TY).to(tl.float32) * w[None, :]
    return y.to(OUT_TY).to(tl.float32)


@triton_jit
def _rotate_heads(
    x_ptr,
    w_ptr,
    tok_stride,
    head_stride,
    num_heads,
    t,
    head_block,
    cos,
    sin,
    offs_j,
    mask_j,
    eps,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    head_ok = heads < num_heads
    mask = head_ok[:, None] & mask_j[None, :]
    row = x_ptr + t * tok_stride + heads[:, None].to(tl.int64) * head_stride
    base = row + offs_j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        ty = x_ptr.dtype.element_ty
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        full = tl.load(row + offs_d[None, :], mask=head_ok[:, None] & d_ok[None, :], other=0.0)
        full = full.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(full * full, axis=1) / HEAD_DIM + eps)
        w_full = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        # Channels past the rotary part (partial rotary) are normalised and stored as is.
        tail = head_ok[:, None] & (d_ok & (offs_d >= 2 * HALF))[None, :]
        tail_out = _normed(full, rstd, w_full, ZERO_CENTERED, ty)
        tl.store(row + offs_d[None, :], tail_out.to(ty), mask=tail)
        w1 = tl.load(w_ptr + offs_j, mask=mask_j, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_j, mask=mask_j, other=0.0).to(tl.float32)
        x1 = _normed(x1, rstd, w1, ZERO_CENTERED, ty)
        x2 = _normed(x2, rstd, w2, ZERO_CENTERED, ty)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(base, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton_jit(do_not_specialize=("pos_axis_stride", "max_pos"))
def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    q_w_ptr,
    k_w_ptr,
    table_ptr,
    pos_ptr,
    axes_ptr,
    flag_ptr,
    q_tok_stride,
    q_head_stride,
    k_tok_stride,
    k_head_stride,
    table_stride,
    pos_axis_stride,
    pos_tok_stride,
    max_pos,
    num_q_heads,
    num_k_heads,
    eps,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_AXES: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    # grid: (T, 2 [q, k], head blocks)
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    head_block = tl.program_id(2)
    offs_j = tl.arange(0, BLOCK_HALF)
    mask_j = offs_j < HALF
    if HAS_POS:
        if HAS_AXES:
            axis = tl.load(axes_ptr + offs_j, mask=mask_j, other=0).to(tl.int64)
        else:
            axis = tl.zeros([BLOCK_HALF], dtype=tl.int64)
        pos = tl.load(pos_ptr + axis * pos_axis_stride + t * pos_tok_stride, mask=mask_j, other=0)
        pos = pos.to(tl.int64)
        bad = ((pos < 0) | (pos >= max_pos)) & mask_j
        row = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
        if HAS_FLAG:
            any_bad = tl.max(bad.to(tl.int32), axis=0)
            tl.store(flag_ptr, 1, mask=(any_bad > 0) & (which == 0) & (head_block == 0))
    else:
        row = tl.zeros([BLOCK_HALF], dtype=tl.int64) + t
    cos = tl.load(table_ptr + row * table_stride + offs_j, mask=mask_j, other=1.0).to(tl.float32)
    sin = tl.load(table_ptr + row * table_stride + HALF + offs_j, mask=mask_j, other=0.0)
    sin = sin.to(tl.float32)
    if which == 0:
        _rotate_heads(
            q_ptr, q_w_ptr, q_tok_stride, q_head_stride, num_q_heads, t, head_block, cos, sin,
            offs_j, mask_j, eps, HALF, BLOCK_HEADS, HEAD_DIM, BLOCK_D, NORM, ZERO_CENTERED,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr, k_w_ptr, k_tok_stride, k_head_stride, num_k_heads, t, head_block, cos, sin,
            offs_j, mask_j, eps, HALF, BLOCK_HEADS, HEAD_DIM, BLOCK_D, NORM, ZERO_CENTERED,
        )  # fmt: skip


def _as_heads(x: torch.Tensor, name: str, num_tokens: int, head_dim: int) -> torch.Tensor:
    """`[T, heads*D]` or `[T, heads, D]` (any token/head strides) -> a `[T, heads, D]` view."""
    if x.dim() == 2:
        if x.shape[1] % head_dim:
            raise ValueError(f"{name} width {x.shape[1]} is not a multiple of head_dim {head_dim}")
        x = x.view(x.shape[0], x.shape[1] // head_dim, head_dim)
    if x.dim() != 3 or x.shape[2] != head_dim or x.shape[0] != num_tokens:
        raise ValueError(
            f"{name} must be [{num_tokens}, heads*{head_dim}] or [{num_tokens}, heads, "
            f"{head_dim}], got {tuple(x.shape)}"
        )
    if x.stride(2) != 1:
        raise ValueError(f"{name} must have a unit stride on its last dim, got {x.stride()}")
    return x


def _normalize_positions(position_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T], [1, T] -> [1, T]; [3, T], [3, 1, T] -> [3, T]."""
    pos = position_ids
    if pos.dim() == 3 and pos.shape[1] == 1:
        pos = pos[:, 0]
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() != 2 or pos.shape[0] not in (1, 3) or pos.shape[1] != num_tokens:
        raise ValueError(
            f"position_ids must be [T], [1, T], [3, T] or [3, 1, T] with T={num_tokens}, "
            f"got {tuple(position_ids.shape)}"
        )
    if pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"position_ids must be int32 or int64, got {pos.dtype}")
    return pos


def _rope_torch(
    q3: torch.Tensor,
    k3: torch.Tensor,
    table: torch.Tensor,
    pos: torch.Tensor | None,
    axes: torch.Tensor | None,
    error_flag: torch.Tensor | None,
) -> None:
    if pos is None:
        cos_sin = table[: q3.shape[0]].float()
    else:
        bad = (pos < 0) | (pos >= table.shape[0])
        if axes is not None:  # Only the axes some frequency reads count as out of range.
            used = torch.zeros(pos.shape[0], dtype=torch.bool, device=pos.device)
            bad = bad & used.index_fill(0, axes.long(), True)[:, None]
        if error_flag is not None:
            torch.maximum(error_flag, bad.any().to(error_flag.dtype).reshape(1), out=error_flag)
        rows = pos.clamp(0, table.shape[0] - 1).long()
        per_axis = table.float()[rows]  # [A, T, rotary_dim]
        if axes is None:
            cos_sin = per_axis[0]
        else:
            index = torch.cat([axes, axes]).long()[None, None, :].expand(1, *per_axis.shape[1:])
            cos_sin = per_axis.gather(0, index)[0]
    q3.copy_(apply_rotary_emb(q3, cos_sin))
    k3.copy_(apply_rotary_emb(k3, cos_sin))


def _check_norm_weights(
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, head_dim: int
) -> bool:
    """True when a fused q/k norm was asked for (both weights, each `[head_dim]`)."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rope_qk_: give both q_norm_weight and k_norm_weight, or neither")
    if q_weight is None:
        return False
    for name, w in (("q_norm_weight", q_weight), ("k_norm_weight", k_weight)):
        if tuple(w.shape) != (head_dim,):
            raise ValueError(f"rope_qk_: {name} must be [{head_dim}], got {tuple(w.shape)}")
    return True


def rope_qk_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_table: torch.Tensor,
    head_dim: int,
    position_ids: torch.Tensor | None = None,
    channel_axes: torch.Tensor | None = None,
    error_flag: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q: [T, H*D | H, D]` and `k: [T, KVH*D | KVH, D]` in place; returns `(q, k)`.

    cos_sin_table: float `[P, rotary_dim]` packed `cat(cos, sin)` (a module's `cos_sin_table`).
    position_ids: `[T]`/`[1, T]` (RoPE), `[3, T]`/`[3, 1, T]` (mRoPE), or None meaning the table
      is already per token (row t for token t, e.g. the output of `get_cos_sin`).
    channel_axes: int `[rotary_dim // 2]` axis (0/1/2) per frequency; required for 3-row
      positions, ignored otherwise.
    error_flag: optional int32 `[1]` set to 1 when any position fell outside `[0, P)`.
    q_norm_weight, k_norm_weight: `[D]` weights of a per-head RMSNorm (`rms_norm` with
      `norm_eps` and `zero_centered`) applied to q and k, in place, before the rotation.
    """
    num_tokens = q.shape[0]
    q3 = _as_heads(q, "q", num_tokens, head_dim)
    k3 = _as_heads(k, "k", num_tokens, head_dim)
    rotary_dim = cos_sin_table.shape[-1]
    if cos_sin_table.dim() != 2 or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"cos_sin_table must be [P, rotary_dim] with an even rotary_dim <= head_dim "
            f"{head_dim}, got {tuple(cos_sin_table.shape)}"
        )
    half = rotary_dim // 2
    pos = None if position_ids is None else _normalize_positions(position_ids, num_tokens)
    if pos is None and cos_sin_table.shape[0] < num_tokens:
        raise ValueError(f"per-token cos_sin has {cos_sin_table.shape[0]} rows for {num_tokens}")
    axes = None
    if pos is not None and pos.shape[0] == 3:
        if channel_axes is None or channel_axes.numel() != half:
            raise ValueError(f"3-row position_ids need channel_axes with {half} entries")
        axes = channel_axes.reshape(half).to(device=q.device, dtype=torch.int32)
    if error_flag is not None and (error_flag.dtype != torch.int32 or error_flag.numel() != 1):
        raise ValueError("error_flag must be an int32 tensor with one element")
    norm = _check_norm_weights(q_norm_weight, k_norm_weight, head_dim)
    if not use_triton("rope_qk_", q.device, backend):
        if norm:
            q3.copy_(rms_norm_torch(q3, q_norm_weight, norm_eps, zero_centered=zero_centered))
            k3.copy_(rms_norm_torch(k3, k_norm_weight, norm_eps, zero_centered=zero_centered))
        _rope_torch(q3, k3, cos_sin_table, pos, axes, error_flag)
        return q, k
    if norm and (
        _norm_kernel_rejects(q3, q_norm_weight, None)
        or _norm_kernel_rejects(k3, k_norm_weight, None)
    ):
        # What the norm kernel does not model (mixed dtypes follow torch's promotion) is
        # normalised separately, by `rms_norm`'s own fallback.
        q3.copy_(rms_norm(q3, q_norm_weight, norm_eps, zero_centered=zero_centered))
        k3.copy_(rms_norm(k3, k_norm_weight, norm_eps, zero_centered=zero_centered))
        norm = False
    table = cos_sin_table if cos_sin_table.stride(1) == 1 else cos_sin_table.contiguous()
    block_heads = min(_MAX_BLOCK_HEADS, triton.next_power_of_2(max(q3.shape[1], k3.shape[1])))
    head_blocks = triton.cdiv(max(q3.shape[1], k3.shape[1]), block_heads)
    dummy = table  # Stands in for absent pointers; never dereferenced (constexpr-gated).
    _rope_qk_kernel[(num_tokens, 2, head_blocks)](
        q3, k3,
        q_norm_weight if norm else dummy,
        k_norm_weight if norm else dummy,
        table,
        dummy if pos is None else pos,
        dummy if axes is None else axes,
        dummy if error_flag is None else error_flag,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), table.stride(0),
        0 if pos is None or pos.shape[0] == 1 else pos.stride(0),
        0 if pos is None else pos.stride(1),
        table.shape[0], q3.shape[1], k3.shape[1], float(norm_eps),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HEADS=block_heads,
        HAS_POS=pos is not None, HAS_AXES=axes is not None, HAS_FLAG=error_flag is not None,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), NORM=norm,
        ZERO_CENTERED=zero_centered, **pdl_launch_kwargs(q3.device, num_tokens * 2 * head_blocks),
    )  # fmt: skip
    return q, k


def apply_rotary_qk_(
    rotary_emb: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    error_flag: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_qk_` with the table, head_dim and channel axes of a `RotaryEmbedding` /
    `MRotaryEmbedding` (`rotary_embedding.py`)."""
    axes = getattr(rotary_emb, "channel_axes", None)
    if axes is not None:
        axes = axes.reshape(-1)[: rotary_emb.rotary_dim // 2]
    return rope_qk_(
        q, k, rotary_emb.cos_sin_table, rotary_emb.head_dim, position_ids, axes, error_flag,
        backend,
    )  # fmt: skip
