"""Pieces shared by the Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers.

Host-side work (grid validation, per-(t,h,w) index tables, segment lengths) happens before any
device math; everything the device needs is packed into ONE int32 host buffer and sent with one
pinned non_blocking copy (`pack_h2d`). Parameter names match HF's tower names, so HF state dicts
(with the `visual.` / `model.visual.` prefix stripped) load 1:1 through `load_tower_weights`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ..._utils import async_tensor_h2d
from ..modules.vision_attention import VarlenSegments, VisionAttention

# Per-(t,h,w) host caches are cleared past this many entries to bound host memory.
GRID_CACHE_MAX_ENTRIES = 4096

_K = TypeVar("_K")
_V = TypeVar("_V")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported vision hidden_act {name!r}; one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def rope_theta_of(config: Any) -> float:
    """Vision rope base from the config (`rope_parameters` in transformers 5, else 10000)."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "axial")
    if rope_type not in ("axial", "default"):
        raise ValueError(f"vision tower supports axial 2D rope only, got rope_type {rope_type!r}")
    return float(params.get("rope_theta", 10000.0))


@dataclass
class VisionTowerOutput:
    """Tower result.

    embeddings: `[N_patches / merge**2, out_hidden]`, items in `grid_thw` order.
    deepstack_embeddings: Qwen3-VL only, one `[N_merged, out_hidden]` tensor per
    `deepstack_visual_indexes` entry (same order); empty for the other towers.
    """

    embeddings: torch.Tensor
    deepstack_embeddings: list[torch.Tensor] = field(default_factory=list)


@dataclass
class VisionInputs:
    """Device-side index tensors for one forward, built by a tower's `prepare_inputs`.

    rope_pos: int32 `[N, 2]` (row, col) per patch, in the order the blocks see the patches.
    segments: per-frame attention segments. The optional fields belong to one tower each.
    """

    rope_pos: torch.Tensor
    segments: VarlenSegments
    grids: list[tuple[int, int, int]]
    window_segments: VarlenSegments | None = None  # Qwen2.5-VL window blocks
    window_index: torch.Tensor | None = None  # int32 [N/m^2], merged units in window order
    reverse_window_index: torch.Tensor | None = None  # int32 [N/m^2], its inverse permutation
    interp_index: torch.Tensor | None = None  # int32 [N, 4], Qwen3-VL pos-embed taps
    interp_weight: torch.Tensor | None = None  # fp32 [N, 4]


def validate_grid_thw(grid_thw: torch.Tensor, merge_size: int) -> list[tuple[int, int, int]]:
    """Check a host `[num_items, 3]` integer grid and return it as Python tuples."""
    if not isinstance(grid_thw, torch.Tensor):
        raise ValueError(f"grid_thw must be a torch.Tensor, got {type(grid_thw).__name__}")
    if grid_thw.device.type != "cpu":
        # Reading a device grid would sync the stream; the input processor keeps it on the host.
        raise ValueError(f"grid_thw must be a host (CPU) tensor, got device {grid_thw.device}")
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
        raise ValueError(f"grid_thw must have shape [num_items>0, 3], got {tuple(grid_thw.shape)}")
    if grid_thw.is_floating_point() or grid_thw.is_complex():
        raise ValueError(f"grid_thw must be an integer tensor, got {grid_thw.dtype}")
    grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
    for t, h, w in grids:
        if t <= 0 or h <= 0 or w <= 0:
            raise ValueError(f"grid_thw entries must be positive, got {(t, h, w)}")
        if h % merge_size or w % merge_size:
            raise ValueError(
                f"grid (h={h}, w={w}) is not divisible by spatial_merge_size {merge_size}"
            )
    return grids


def check_pixel_values(pixel_values: torch.Tensor, patch_dim: int, num_patches: int) -> None:
    if pixel_values.dim() != 2 or pixel_values.shape[1] != patch_dim:
        raise ValueError(
            f"pixel_values must have shape [N_patches, {patch_dim}], "
            f"got {tuple(pixel_values.shape)}"
        )
    if pixel_values.shape[0] != num_patches:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[0]} patches but grid_thw describes {num_patches}"
        )


def cache_get(cache: dict[_K, _V], key: _K, build: Callable[..., _V]) -> _V:
    """Plain-dict memo; cleared wholesale when it grows past GRID_CACHE_MAX_ENTRIES.

    `build` is called with no arguments; it is typed `Callable[..., _V]` because the callers
    pass `lambda g=g: ...` (the loop variable bound as a default), which mypy cannot match
    against `Callable[[], _V]`.
    """
    hit = cache.get(key)
    if hit is None:
        if len(cache) >= GRID_CACHE_MAX_ENTRIES:
            cache.clear()
        hit = cache[key] = build()
    return hit


def merge_order_rows_cols(h: int, w: int, merge: int) -> torch.Tensor:
    """int32 `[h*w, 2]` (row, col) of each patch of one frame, in merge-window order.

    The processor emits patches block by block: merge x merge blocks in raster order, and
    raster order inside each block, so the merger can view `merge**2` neighbours as one row.
    """
    rows = torch.arange(h, dtype=torch.int32)[:, None].expand(h, w)
    cols = torch.arange(w, dtype=torch.int32)[None, :].expand(h, w)
    grid = torch.stack([rows, cols], dim=-1).reshape(h // merge, merge, w // merge, merge, 2)
    return grid.permute(0, 2, 1, 3, 4).reshape(h * w, 2).contiguous()


def pack_h2d(parts: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Send several small host int32/int64/float32 tensors with ONE pinned non_blocking copy.

    Each part comes back as a view of the single device buffer, with its shape; int64 parts come
    back as int32 (values must fit), float32 parts are bit-cast through int32 and back.
    """
    flat: list[torch.Tensor] = []
    for name, t in parts.items():
        if t.dtype == torch.float32:
            flat.append(t.reshape(-1).view(torch.int32))
        elif t.dtype in (torch.int32, torch.int64):
            flat.append(t.reshape(-1).to(torch.int32))
        else:
            raise ValueError(f"pack_h2d part {name!r} has unsupported dtype {t.dtype}")
    device_buf = async_tensor_h2d(torch.cat(flat), torch.int32, device)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, t in parts.items():
        view = device_buf[offset : offset + t.numel()]
        offset += t.numel()
        if t.dtype == torch.float32:
            view = view.view(torch.float32)
        out[name] = view.view(t.shape)
    return out


class VisionRotaryTable(nn.Module):
    """Axial 2D rope for vision patches from precomputed cos/sin tables.

    A quarter of head_dim rotates with the patch row, a quarter with the column, and the halves
    repeat (HF layout). Tables hold positions `0..max_side-1`; `ensure_side` grows them on the
    host-prep path, so forward is a pure gather with no `.cos()`/`.sin()`.
    """

    # Buffers, declared so their reads type as tensors, not `Tensor | Module`.
    inv_freq: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, head_dim: int, theta: float, max_side: int = 128) -> None:
        super().__init__()
        if head_dim % 4 != 0:
            raise ValueError(f"vision head_dim {head_dim} must be divisible by 4 for 2D rope")
        half = head_dim // 2
        # explicit device: the tables are real even when the model is built on meta
        steps = torch.arange(0, half, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / (theta ** (steps / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        empty = torch.empty(0, half // 2, device="cpu")
        self.register_buffer("cos_table", empty, persistent=False)
        self.register_buffer("sin_table", empty.clone(), persistent=False)
        self.ensure_side(max_side)

    @property
    def max_side(self) -> int:
        return self.cos_table.shape[0]

    def ensure_side(self, side: int) -> None:
        """Grow the tables (at least doubling) so positions `< side` are covered."""
        if side <= self.max_side:
            return
        new_side = max(side, 2 * self.max_side)
        pos = torch.arange(new_side, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        self.cos_table = freqs.cos()
        self.sin_table = freqs.sin()

    def forward(self, rope_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_pos int `[N, 2]` -> (cos, sin), each fp32 `[N, head_dim]`."""
        n = rope_pos.shape[0]
        cos = self.cos_table[rope_pos].reshape(n, -1)
        sin = self.sin_table[rope_pos].reshape(n, -1)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class PatchEmbed(nn.Module):
    """Conv3d patchifier (HF name `proj`), run as one matmul since kernel == stride."""

    def __init__(
        self, in_channels: int, temporal: int, patch: int, dim: int, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.patch_dim = in_channels * temporal * patch * patch
        self.proj = nn.Conv3d(in_channels, dim, kernel, stride=kernel, bias=bias, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        x = pixel_values.to(weight.dtype)
        return F.linear(x, weight.view(weight.shape[0], -1), self.proj.bias)


class VisionRMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back (Qwen2.5-VL vision norm; HF name `weight`)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class VisionBlock(nn.Module):
    """Pre-norm transformer block; HF names `norm1`, `attn`, `norm2`, `mlp`."""

    def __init__(
        self, norm1: nn.Module, attn: VisionAttention, norm2: nn.Module, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.norm1 = norm1
        self.norm2 = norm2
        self.attn = attn
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: VarlenSegments
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


def load_tower_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy HF tower weights (prefix already stripped) into `module`'s parameters.

    Raises ValueError naming missing keys, unexpected keys, or shape mismatches.
    """
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"{type(module).__name__}.load_weights: missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}"
        )
    for name, param in params.items():
        src = weights[name]
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(
                f"{type(module).__name__}.load_weights: {name} has shape {tuple(src.shape)}, "
                f"expected {tuple(param.shape)}"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name].to(device=param.device, dtype=param.dtype))
