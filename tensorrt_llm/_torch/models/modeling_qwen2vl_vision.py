"""Qwen2-VL and Qwen2.5-VL vision towers (HF-parity, standalone torch modules).

Both towers: Conv3d patch embed -> blocks of packed varlen attention with axial 2D rope ->
patch merger (merge x merge neighbours -> one LLM token). Qwen2.5-VL adds window attention: patches
are permuted into window order once after the patch embed, most blocks attend inside windows and
`fullatt_block_indexes` blocks inside whole frames, and the merged tokens are permuted back.

forward(pixel_values [N_patches, C*tp*p*p], grid_thw host int [num_items, 3]) -> VisionTowerOutput
with `embeddings` `[N_patches / merge**2, out_hidden]` (no deepstack outputs here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..modules.vision_attention import VarlenSegments, VisionAttention
from .modeling_qwen_vision_common import (
    PatchEmbed,
    VisionBlock,
    VisionInputs,
    VisionRMSNorm,
    VisionRotaryTable,
    VisionTowerOutput,
    cache_get,
    check_pixel_values,
    get_activation,
    load_tower_weights,
    merge_order_rows_cols,
    pack_h2d,
    rope_theta_of,
    validate_grid_thw,
)

_EPS = 1e-6


class VisionMLP(nn.Module):
    """Qwen2-VL block MLP (HF names `fc1`, `fc2`)."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL block MLP (HF names `gate_proj`, `up_proj`, `down_proj`, all with bias)."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, dtype=dtype)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PatchMerger(nn.Module):
    """Norm each patch, concat merge**2 neighbours, 2-layer GELU MLP (HF: `ln_q`, `mlp.0/2`)."""

    def __init__(
        self, dim: int, out_dim: int, merge: int, norm: nn.Module, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.merged_dim = dim * merge * merge
        self.ln_q = norm
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim, dtype=dtype),
            nn.GELU(),
            nn.Linear(self.merged_dim, out_dim, dtype=dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class _Qwen2VisionBase(nn.Module):
    """Shared skeleton: patch embed, rope table, blocks, merger, per-grid host caches."""

    def _init_base(
        self,
        config: Any,
        dim: int,
        dtype: torch.dtype,
        blocks: list[VisionBlock],
        merger: nn.Module,
    ) -> None:
        self.merge = int(config.spatial_merge_size)
        self.num_heads = int(config.num_heads)
        # Qwen2/2.5-VL patch embeds have no bias.
        self.patch_embed = PatchEmbed(
            config.in_channels, config.temporal_patch_size, config.patch_size, dim, False, dtype
        )
        self.rotary_pos_emb = VisionRotaryTable(dim // self.num_heads, rope_theta_of(config))
        self.blocks = nn.ModuleList(blocks)
        self.merger = merger
        # (t, h, w) -> host index tables for one item; see `_item_tables`.
        self._grid_cache: dict[tuple[int, int, int], Any] = {}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF tower weights with the `visual.` / `model.visual.` prefix stripped."""
        load_tower_weights(self, weights)

    def _device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def _frame_seqlens(self, grids: list[tuple[int, int, int]]) -> list[int]:
        # NOTE: each video frame is its own full-attention segment (HF semantics).
        return [h * w for t, h, w in grids for _ in range(t)]

    def _check(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> list[tuple[int, int, int]]:
        grids = validate_grid_thw(grid_thw, self.merge)
        num_patches = sum(t * h * w for t, h, w in grids)
        check_pixel_values(pixel_values, self.patch_embed.patch_dim, num_patches)
        self.rotary_pos_emb.ensure_side(max(max(h, w) for _, h, w in grids))
        return grids


class Qwen2VisionModel(_Qwen2VisionBase):
    """Qwen2-VL vision tower; `config` is a `Qwen2VLVisionConfig`."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, attn_backend: str = "auto"):
        super().__init__()
        dim, heads = int(config.embed_dim), int(config.num_heads)
        hidden = int(dim * config.mlp_ratio)
        blocks = [
            VisionBlock(
                nn.LayerNorm(dim, eps=_EPS, dtype=dtype),
                VisionAttention(dim, heads, dtype, attn_backend),
                nn.LayerNorm(dim, eps=_EPS, dtype=dtype),
                VisionMLP(dim, hidden, config.hidden_act, dtype),
            )
            for _ in range(config.depth)
        ]
        norm = nn.LayerNorm(dim, eps=_EPS, dtype=dtype)
        merge = int(config.spatial_merge_size)
        merger = PatchMerger(dim, int(config.hidden_size), merge, norm, dtype)
        self._init_base(config, dim, dtype, blocks, merger)

    def _item_tables(self, t: int, h: int, w: int) -> torch.Tensor:
        return merge_order_rows_cols(h, w, self.merge).repeat(t, 1)

    def prepare_inputs(
        self, grids: list[tuple[int, int, int]], device: torch.device
    ) -> VisionInputs:
        """Host tables for validated `grids`, moved to `device` in one non_blocking copy."""
        rope = [cache_get(self._grid_cache, g, lambda g=g: self._item_tables(*g)) for g in grids]
        seqlens = self._frame_seqlens(grids)
        dev = pack_h2d(
            {"rope_pos": torch.cat(rope), "cu": VarlenSegments.host_cu_seqlens(seqlens)}, device
        )
        segments = VarlenSegments.from_seqlens(seqlens, dev["cu"])
        return VisionInputs(rope_pos=dev["rope_pos"], segments=segments, grids=grids)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionTowerOutput:
        grids = self._check(pixel_values, grid_thw)
        inputs = self.prepare_inputs(grids, self._device())
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary_pos_emb(inputs.rope_pos)
        for block in self.blocks:
            x = block(x, cos, sin, inputs.segments)
        return VisionTowerOutput(self.merger(x))


@dataclass(frozen=True)
class _WindowTables:
    """Host tables of one (t, h, w) item for Qwen2.5-VL window attention."""

    rope_pos: torch.Tensor  # int32 [t*h*w, 2], patches in window order
    window_index: torch.Tensor  # int64 [t*h*w/m^2], merged units in window order (item-local)
    reverse_index: torch.Tensor  # int64, inverse permutation of window_index
    window_seqlens: tuple[int, ...]  # patches per window


def window_layout(
    t: int, h: int, w: int, merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """Window order of one item's merged units and the patch count of each window.

    Windows are `window x window` merged units, tiled per frame from the top-left; edge windows are
    smaller. Units inside a window stay in raster order; frames stay contiguous, so per-frame
    segments remain valid after the permutation.
    """
    hm, wm = h // merge, w // merge
    nh, nw = -(-hm // window), -(-wm // window)
    idx = torch.arange(t * hm * wm).view(t, hm, wm)
    padded = F.pad(idx, (0, nw * window - wm, 0, nh * window - hm), value=-1)
    tiles = padded.view(t, nh, window, nw, window).permute(0, 1, 3, 2, 4)
    tiles = tiles.reshape(t * nh * nw, window * window)
    valid = tiles >= 0
    lens = (valid.sum(1) * merge * merge).tolist()
    return tiles[valid], lens


class Qwen2_5_VisionModel(_Qwen2VisionBase):
    """Qwen2.5-VL vision tower with window attention; `config` is a `Qwen2_5_VLVisionConfig`."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, attn_backend: str = "auto"):
        super().__init__()
        dim, heads = int(config.hidden_size), int(config.num_heads)
        inter = int(config.intermediate_size)
        blocks = [
            VisionBlock(
                VisionRMSNorm(dim, _EPS, dtype),
                VisionAttention(dim, heads, dtype, attn_backend),
                VisionRMSNorm(dim, _EPS, dtype),
                GatedVisionMLP(dim, inter, config.hidden_act, dtype),
            )
            for _ in range(config.depth)
        ]
        merge = int(config.spatial_merge_size)
        merger = PatchMerger(
            dim, int(config.out_hidden_size), merge, VisionRMSNorm(dim, _EPS, dtype), dtype
        )
        self._init_base(config, dim, dtype, blocks, merger)
        self.window = int(config.window_size) // merge // int(config.patch_size)
        if self.window < 1:
            raise ValueError(
                f"window_size {config.window_size} is smaller than one merged unit "
                f"(patch_size {config.patch_size} x spatial_merge_size {merge})"
            )
        self.fullatt_block_indexes = frozenset(int(i) for i in config.fullatt_block_indexes)

    def _item_tables(self, t: int, h: int, w: int) -> _WindowTables:
        unit = self.merge * self.merge
        index, lens = window_layout(t, h, w, self.merge, self.window)
        rope = merge_order_rows_cols(h, w, self.merge).repeat(t, 1)
        rope = rope.view(-1, unit, 2)[index].reshape(-1, 2)
        reverse = torch.empty_like(index)
        reverse[index] = torch.arange(index.numel())
        return _WindowTables(rope, index, reverse, tuple(lens))

    def prepare_inputs(
        self, grids: list[tuple[int, int, int]], device: torch.device
    ) -> VisionInputs:
        """Host tables for validated `grids`, moved to `device` in one non_blocking copy."""
        tables = [cache_get(self._grid_cache, g, lambda g=g: self._item_tables(*g)) for g in grids]
        index, reverse, win_lens = [], [], []
        offset = 0
        for tab in tables:
            index.append(tab.window_index + offset)
            reverse.append(tab.reverse_index + offset)
            win_lens.extend(tab.window_seqlens)
            offset += tab.window_index.numel()
        frame_lens = self._frame_seqlens(grids)
        parts = {
            "rope_pos": torch.cat([tab.rope_pos for tab in tables]),
            "cu": VarlenSegments.host_cu_seqlens(frame_lens),
            "cu_window": VarlenSegments.host_cu_seqlens(win_lens),
            "window_index": torch.cat(index),
            "reverse": torch.cat(reverse),
        }
        dev = pack_h2d(parts, device)
        return VisionInputs(
            rope_pos=dev["rope_pos"],
            segments=VarlenSegments.from_seqlens(frame_lens, dev["cu"]),
            grids=grids,
            window_segments=VarlenSegments.from_seqlens(win_lens, dev["cu_window"]),
            window_index=dev["window_index"],
            reverse_window_index=dev["reverse"],
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionTowerOutput:
        grids = self._check(pixel_values, grid_thw)
        inputs = self.prepare_inputs(grids, self._device())
        assert inputs.window_index is not None and inputs.window_segments is not None
        x = self.patch_embed(pixel_values)
        dim = x.shape[-1]
        x = x.view(-1, self.merge * self.merge, dim)[inputs.window_index].view(-1, dim)
        cos, sin = self.rotary_pos_emb(inputs.rope_pos)
        for i, block in enumerate(self.blocks):
            full = i in self.fullatt_block_indexes
            x = block(x, cos, sin, inputs.segments if full else inputs.window_segments)
        return VisionTowerOutput(self.merger(x)[inputs.reverse_window_index])
