"""Qwen3-VL vision tower (also used by Qwen3.5), HF-parity standalone torch module.

Differences from Qwen2-VL: a learned position embedding on a square `side x side` grid, bilinearly
resampled (align_corners) to each item's `(h, w)` and added after the patch embed; and
"deepstack": the hidden states after each block in `deepstack_visual_indexes` go through their own
merger, and the results are injected into the early LLM layers.

forward(pixel_values [N_patches, C*tp*p*p], grid_thw host int [num_items, 3]) -> VisionTowerOutput:
`embeddings` `[N_patches / merge**2, out_hidden]` and `deepstack_embeddings`, one
`[N_merged, out_hidden]` tensor per `deepstack_visual_indexes` entry.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..modules.triton_kernels.pos_embed_interp import interpolate_pos_embed
from ..modules.vision_attention import VarlenSegments, VisionAttention
from .modeling_qwen_vision_common import (
    PatchEmbed,
    VisionBlock,
    VisionInputs,
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


def interpolate_pos_embed_reference(
    pos_embed_weight: torch.Tensor,
    grid_thw: torch.Tensor,
    num_grid_per_side: int,
    merge_size: int,
) -> torch.Tensor:
    """Torch reference of Qwen3-VL's position-embedding resampling.

    pos_embed_weight: `[>= side*side, D]` learned table, row `r*side + c` is grid point (r, c).
    grid_thw: host int `[num_items, 3]`.
    Returns `[sum(t*h*w), D]` in `pos_embed_weight.dtype` (math in fp32): per item, the table is
    bilinearly resampled to `h x w` with corners aligned (point i of n maps to i*(side-1)/(n-1)),
    reordered into merge-window patch order, and repeated for each of the t frames.
    """
    side = int(num_grid_per_side)
    if pos_embed_weight.shape[0] < side * side:
        raise ValueError(
            f"pos_embed has {pos_embed_weight.shape[0]} rows, fewer than side**2 = {side * side}"
        )
    grids = validate_grid_thw(grid_thw, merge_size)
    dev = pos_embed_weight.device
    table = pos_embed_weight[: side * side].float().view(side, side, -1)
    dim = table.shape[-1]
    out = []
    for t, h, w in grids:

        def axis(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            src = torch.linspace(0, side - 1, n, dtype=torch.float64, device=dev)
            lo = src.floor().long()
            hi = (lo + 1).clamp(max=side - 1)
            return lo, hi, (src - lo).float()

        r0, r1, dr = axis(h)
        c0, c1, dc = axis(w)
        dc3 = dc[None, :, None]
        top = table[r0][:, c0] * (1 - dc3) + table[r0][:, c1] * dc3
        bottom = table[r1][:, c0] * (1 - dc3) + table[r1][:, c1] * dc3
        emb = top * (1 - dr[:, None, None]) + bottom * dr[:, None, None]
        m = merge_size
        emb = emb.view(h // m, m, w // m, m, dim).permute(0, 2, 1, 3, 4).reshape(h * w, dim)
        out.append(emb.repeat(t, 1))
    return torch.cat(out).to(pos_embed_weight.dtype)


def interpolation_taps(h: int, w: int, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host gather taps for one frame: int32 `[h*w, 4]` table rows and fp32 `[h*w, 4]` weights.

    Same resampling as `interpolate_pos_embed_reference`, expressed as 4 weighted table rows per
    patch (merge-window order), so the device does one gather + weighted sum.
    """
    rc = merge_order_rows_cols(h, w, merge).long()

    def axis(pos: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src = pos.double() * (side - 1) / max(n - 1, 1)
        lo = src.floor()
        return lo.long(), (lo.long() + 1).clamp(max=side - 1), src - lo

    r0, r1, dr = axis(rc[:, 0], h)
    c0, c1, dc = axis(rc[:, 1], w)
    index = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], dim=1)
    weight = torch.stack([(1 - dr) * (1 - dc), (1 - dr) * dc, dr * (1 - dc), dr * dc], dim=1)
    return index.to(torch.int32), weight.float()


class Qwen3VisionMLP(nn.Module):
    """Block MLP (HF names `linear_fc1`, `linear_fc2`)."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, dtype=dtype)
        self.linear_fc2 = nn.Linear(hidden, dim, dtype=dtype)
        self.act_fn = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VisionPatchMerger(nn.Module):
    """Merger (HF names `norm`, `linear_fc1`, `linear_fc2`).

    The final merger normalises each patch before the merge-shuffle; deepstack mergers
    (`postshuffle_norm`) normalise the concatenated merge**2 patches instead.
    """

    def __init__(
        self, dim: int, out_dim: int, merge: int, postshuffle_norm: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.merged_dim = dim * merge * merge
        self.postshuffle_norm = postshuffle_norm
        norm_dim = self.merged_dim if postshuffle_norm else dim
        self.norm = nn.LayerNorm(norm_dim, eps=_EPS, dtype=dtype)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim, dtype=dtype)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_dim, out_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VisionModel(nn.Module):
    """Qwen3-VL / Qwen3.5 vision tower; `config` is a `Qwen3VLVisionConfig` (or Qwen3.5's)."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, attn_backend: str = "auto"):
        super().__init__()
        dim, heads = int(config.hidden_size), int(config.num_heads)
        self.merge = int(config.spatial_merge_size)
        out_dim = int(config.out_hidden_size)
        self.num_grid_per_side = math.isqrt(int(config.num_position_embeddings))
        self.deepstack_visual_indexes = tuple(
            int(i) for i in getattr(config, "deepstack_visual_indexes", None) or ()
        )
        self._check_deepstack(int(config.depth))
        self.patch_embed = PatchEmbed(
            config.in_channels, config.temporal_patch_size, config.patch_size, dim, True, dtype
        )
        self.pos_embed = nn.Embedding(int(config.num_position_embeddings), dim, dtype=dtype)
        self.rotary_pos_emb = VisionRotaryTable(dim // heads, rope_theta_of(config))
        self.blocks = nn.ModuleList(
            VisionBlock(
                nn.LayerNorm(dim, eps=_EPS, dtype=dtype),
                VisionAttention(dim, heads, dtype, attn_backend),
                nn.LayerNorm(dim, eps=_EPS, dtype=dtype),
                Qwen3VisionMLP(dim, int(config.intermediate_size), config.hidden_act, dtype),
            )
            for _ in range(config.depth)
        )
        self.merger = Qwen3VisionPatchMerger(dim, out_dim, self.merge, False, dtype)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VisionPatchMerger(dim, out_dim, self.merge, True, dtype)
            for _ in self.deepstack_visual_indexes
        )
        self._deepstack_slot = {layer: i for i, layer in enumerate(self.deepstack_visual_indexes)}
        # (t, h, w) -> (rope_pos, interp_index, interp_weight) host tables for one item.
        self._grid_cache: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    def _check_deepstack(self, depth: int) -> None:
        idx = self.deepstack_visual_indexes
        if any(i < 0 or i >= depth for i in idx) or list(idx) != sorted(set(idx)):
            raise ValueError(
                f"deepstack_visual_indexes {list(idx)} must be strictly increasing in [0, {depth})"
            )

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF tower weights with the `visual.` / `model.visual.` prefix stripped."""
        load_tower_weights(self, weights)

    def _item_tables(self, t: int, h: int, w: int) -> tuple[torch.Tensor, ...]:
        rope = merge_order_rows_cols(h, w, self.merge).repeat(t, 1)
        index, weight = interpolation_taps(h, w, self.num_grid_per_side, self.merge)
        return rope, index.repeat(t, 1), weight.repeat(t, 1)

    def prepare_inputs(
        self, grids: list[tuple[int, int, int]], device: torch.device
    ) -> VisionInputs:
        """Host tables for validated `grids`, moved to `device` in one non_blocking copy."""
        tables = [cache_get(self._grid_cache, g, lambda g=g: self._item_tables(*g)) for g in grids]
        seqlens = [h * w for t, h, w in grids for _ in range(t)]
        parts = {
            "rope_pos": torch.cat([tab[0] for tab in tables]),
            "interp_index": torch.cat([tab[1] for tab in tables]),
            "interp_weight": torch.cat([tab[2] for tab in tables]),
            "cu": VarlenSegments.host_cu_seqlens(seqlens),
        }
        dev = pack_h2d(parts, device)
        return VisionInputs(
            rope_pos=dev["rope_pos"],
            segments=VarlenSegments.from_seqlens(seqlens, dev["cu"]),
            grids=grids,
            interp_index=dev["interp_index"],
            interp_weight=dev["interp_weight"],
        )

    def interpolate_pos_embed(self, inputs: VisionInputs) -> torch.Tensor:
        """`[N, D]` fp32 resampled position embeddings: the Triton kernel on CUDA."""
        weight = self.pos_embed.weight
        if weight.is_cuda:
            return interpolate_pos_embed(
                weight, inputs.grids, self.num_grid_per_side, self.merge, out_dtype=torch.float32
            )
        assert inputs.interp_index is not None and inputs.interp_weight is not None
        taps = F.embedding(inputs.interp_index, self.pos_embed.weight)  # [N, 4, D]
        return (taps * inputs.interp_weight[..., None]).sum(1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionTowerOutput:
        grids = validate_grid_thw(grid_thw, self.merge)
        num_patches = sum(t * h * w for t, h, w in grids)
        check_pixel_values(pixel_values, self.patch_embed.patch_dim, num_patches)
        self.rotary_pos_emb.ensure_side(max(max(h, w) for _, h, w in grids))
        inputs = self.prepare_inputs(grids, self.patch_embed.proj.weight.device)

        x = self.patch_embed(pixel_values)
        x = x + self.interpolate_pos_embed(inputs).to(x.dtype)
        cos, sin = self.rotary_pos_emb(inputs.rope_pos)
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, inputs.segments)
            slot = self._deepstack_slot.get(i)
            if slot is not None:
                deepstack.append(self.deepstack_merger_list[slot](x))
        return VisionTowerOutput(self.merger(x), deepstack)
