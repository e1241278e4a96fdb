"""Rotary position embeddings: 1-D RoPE and multimodal RoPE (mRoPE) with precomputed tables.

Layout contract (docs/interfaces.md): `get_cos_sin(...)` returns float32 `[T, rotary_dim]` packed
as `cat(cos, sin)` over the `rotary_dim // 2` frequencies. Rotation is the neox / HF
`rotate_half` style: frequency j rotates channels (j, j + rotary_dim // 2). With
`rotary_dim < head_dim` only the first `rotary_dim` channels of each head rotate.

YaRN (`YarnScaling`, HF `rope_type: "yarn"`) changes the inverse frequencies and multiplies the
whole table by its attention factor, as HF scales cos and sin by `attention_scaling`; every
consumer (`get_cos_sin`, the fused `rope_qk_` kernel) reads the scaled table as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# HF `rope_type` values we implement; "mrope" is the legacy Qwen2-VL name for default RoPE.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "mrope", "yarn")
# Keys of an HF rope dict that are not scaling parameters (read by `build_rotary_embedding`).
_COMMON_ROPE_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
        "mrope_section",
        "mrope_interleaved",
    }
)
_YARN_KEYS = frozenset(
    {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    }
)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters with HF's semantics (`_compute_yarn_parameters`, transformers 5).

    `beta_fast` / `beta_slow` bound the ramp between extrapolated (fast, short-wavelength)
    and interpolated (slow) frequencies, counted in rotations over `original_max_positions`.
    """

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_positions <= 0:
            raise ValueError(
                f"YaRN needs a positive factor and original_max_position_embeddings, got "
                f"factor={self.factor}, original_max_position_embeddings="
                f"{self.original_max_positions}"
            )

    def resolved_attention_factor(self) -> float:
        """The factor cos and sin are multiplied by (HF `attention_scaling`)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        # NOTE: HF uses mscale only when mscale_all_dim is also set (and both non-zero).
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)

    def _correction_dim(self, rotations: float, rotary_dim: int, base: float) -> float:
        # The frequency index whose wavelength fits `rotations` times in the original context.
        ratio = self.original_max_positions / (rotations * 2 * math.pi)
        return rotary_dim * math.log(ratio) / (2 * math.log(base))

    def inv_freq(self, base: float, rotary_dim: int, device: torch.device | str) -> torch.Tensor:
        """float32 `[rotary_dim // 2]`: per frequency a blend of `1 / base^(2j/d)`
        (extrapolation) and the same divided by `factor` (interpolation)."""
        low = self._correction_dim(self.beta_fast, rotary_dim, base)
        high = self._correction_dim(self.beta_slow, rotary_dim, base)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
        pos_freqs = base ** (exponent / rotary_dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        index = torch.arange(rotary_dim // 2, dtype=torch.int64, device=device).float()
        ramp = ((index - low) / (high - low)).clamp(0, 1)
        extrapolation_weight = 1 - ramp
        return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _rope_float(rope: Mapping[str, Any], key: str) -> float | None:
    value = rope.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"rope_scaling {key!r} must be a number, got {value!r}")
    return float(value)


def parse_rope_scaling(
    rope: Mapping[str, Any],
    max_position_embeddings: int,
    original_max_position_embeddings: int | None = None,
) -> YarnScaling | None:
    """The scaling an HF `rope_parameters` / `rope_scaling` dict asks for: None for plain RoPE
    (default / mrope), `YarnScaling` for YaRN; any other `rope_type`, or a YaRN key we do not
    know, is a ValueError.

    `original_max_position_embeddings` is the config's top-level field of that name (HF gives
    it priority over the dict's); without either, HF falls back to `max_position_embeddings`.
    """
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}: supported rope types are "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type != "yarn":
        return None
    unknown = sorted(set(rope) - _COMMON_ROPE_KEYS - _YARN_KEYS)
    if unknown:
        raise ValueError(
            f"unsupported rope_scaling keys {unknown} for rope_type 'yarn' (known: "
            f"{sorted(_YARN_KEYS)})"
        )
    if "factor" not in rope:
        raise ValueError("rope_type 'yarn' needs a 'factor' in rope_scaling / rope_parameters")
    original = original_max_position_embeddings
    if original is None:
        original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    factor = _rope_float(rope, "factor")
    if factor is None:  # HF: the ratio of the extended to the original context
        factor = max_position_embeddings / original
    return YarnScaling(
        factor=factor,
        original_max_positions=int(original),
        # HF: `or` defaults, so 0 and None both mean the paper's 32 / 1.
        beta_fast=_rope_float(rope, "beta_fast") or 32.0,
        beta_slow=_rope_float(rope, "beta_slow") or 1.0,
        mscale=_rope_float(rope, "mscale"),
        mscale_all_dim=_rope_float(rope, "mscale_all_dim"),
        attention_factor=_rope_float(rope, "attention_factor"),
        truncate=bool(rope.get("truncate", True)),
    )


def _check_dims(head_dim: int, rotary_dim: int, max_positions: int) -> None:
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} exceeds head_dim {head_dim}")
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")


class RotaryEmbedding(nn.Module):
    """Standard RoPE. The cos/sin table is built once at init; forward only indexes it.

    NOTE: the table is built on `device` (CPU by default) with an explicit device argument,
    so building the model under `torch.device("meta")` still yields real values.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int | None = None,
        base: float = 10000.0,
        max_positions: int = 32768,
        device: torch.device | str = "cpu",
        *,
        scaling: YarnScaling | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        _check_dims(head_dim, rotary_dim, max_positions)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.max_positions = max_positions
        self.scaling = scaling
        if scaling is None:
            exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
            inv_freq = 1.0 / (self.base ** (exponent / rotary_dim))
            self.attention_scaling = 1.0
        else:
            inv_freq = scaling.inv_freq(self.base, rotary_dim, device)
            self.attention_scaling = scaling.resolved_attention_factor()
        positions = torch.arange(max_positions, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [P, rotary_dim // 2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # [P, rotary_dim] float32: cat(cos, sin)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if scaling is not None:
            # HF multiplies cos and sin (so q.k by its square); the table carries it.
            table = table * self.attention_scaling
        self.register_buffer("cos_sin_table", table, persistent=False)

    def _lookup(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.cos_sin_table.index_select(0, position_ids.reshape(-1))

    def get_cos_sin(self, position_ids: torch.Tensor) -> torch.Tensor:
        """`position_ids: [T]` (or `[1, T]`) -> float32 `[T, rotary_dim]`."""
        if position_ids.dim() == 2 and position_ids.shape[0] == 1:
            position_ids = position_ids[0]
        if position_ids.dim() != 1:
            raise ValueError(
                f"RotaryEmbedding expects position_ids [T], got shape {tuple(position_ids.shape)}"
            )
        return self._lookup(position_ids)

    def extra_repr(self) -> str:
        text = (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, "
            f"max_positions={self.max_positions}"
        )
        return text if self.scaling is None else f"{text}, scaling={self.scaling}"


def mrope_channel_axes(mrope_section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """Which position axis (0=T, 1=H, 2=W) drives each of the `sum(mrope_section)` frequencies.

    Contiguous (Qwen2/2.5-VL): `[T]*s0 + [H]*s1 + [W]*s2`.
    Interleaved (Qwen3-VL, Qwen3.5): frequency 3k+1 is H for k < s1, 3k+2 is W for k < s2, and
    every other frequency (including the tail past the interleaved prefix) is T.
    """
    if len(mrope_section) != 3 or any(int(s) < 0 for s in mrope_section):
        raise ValueError(f"mrope_section must be 3 non-negative ints, got {list(mrope_section)}")
    s_t, s_h, s_w = (int(s) for s in mrope_section)
    half = s_t + s_h + s_w
    if not interleaved:
        return torch.tensor([0] * s_t + [1] * s_h + [2] * s_w, dtype=torch.int64, device="cpu")
    # NOTE: explicit CPU device so this also works under a `torch.device("meta")` context.
    axes = torch.zeros(half, dtype=torch.int64, device="cpu")
    h_idx = torch.arange(1, 3 * s_h, 3, device="cpu")
    w_idx = torch.arange(2, 3 * s_w, 3, device="cpu")
    if (h_idx.numel() and h_idx[-1] >= half) or (w_idx.numel() and w_idx[-1] >= half):
        raise ValueError(
            f"interleaved mrope_section {list(mrope_section)} does not fit {half} frequencies"
        )
    axes[h_idx] = 1
    axes[w_idx] = 2
    return axes


class MRotaryEmbedding(RotaryEmbedding):
    """mRoPE: each frequency takes its angle from one of three position axes (T, H, W).

    `mrope_section` counts frequencies per axis and must sum to `rotary_dim // 2`.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int | None = None,
        base: float = 10000.0,
        max_positions: int = 32768,
        mrope_section: Sequence[int] = (16, 24, 24),
        interleaved: bool = False,
        device: torch.device | str = "cpu",
        *,
        scaling: YarnScaling | None = None,
    ) -> None:
        super().__init__(head_dim, rotary_dim, base, max_positions, device, scaling=scaling)
        section = [int(s) for s in mrope_section]
        if len(section) != 3 or sum(section) != self.rotary_dim // 2:
            raise ValueError(
                f"mrope_section {section} must have 3 entries summing to rotary_dim // 2 = "
                f"{self.rotary_dim // 2}"
            )
        self.mrope_section = tuple(section)
        self.interleaved = interleaved
        axes = mrope_channel_axes(section, interleaved).to(device)
        # The same axis choice applies to the cos half and the sin half of the packed table.
        self.register_buffer(
            "channel_axes", torch.cat([axes, axes])[None, None, :], persistent=False
        )

    def get_cos_sin(self, position_ids: torch.Tensor) -> torch.Tensor:
        """`position_ids: [3, T]` (or `[3, 1, T]`, or `[T]` for text) -> f32 `[T, rotary_dim]`."""
        if position_ids.dim() == 3 and position_ids.shape[1] == 1:
            position_ids = position_ids[:, 0]
        if position_ids.dim() == 1:
            return self._lookup(position_ids)
        if position_ids.dim() != 2 or position_ids.shape[0] != 3:
            raise ValueError(
                "MRotaryEmbedding expects position_ids [3, T], [3, 1, T] or [T], got shape "
                f"{tuple(position_ids.shape)}"
            )
        num_tokens = position_ids.shape[1]
        per_axis = self._lookup(position_ids).view(3, num_tokens, self.rotary_dim)
        index = self.channel_axes.expand(1, num_tokens, self.rotary_dim)
        return per_axis.gather(0, index)[0]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={list(self.mrope_section)}, " + (
            f"interleaved={self.interleaved}"
        )


def apply_rotary_emb(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [T, H, D]` with packed `cos_sin: [T, rotary_dim]`; channels past
    `rotary_dim` pass through. Computed in float32, returned in `x.dtype`."""
    rotary_dim = cos_sin.shape[-1]
    half = rotary_dim // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    x_rot = x[..., :rotary_dim].float()
    x1, x2 = x_rot[..., :half], x_rot[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
