"""The vision tower data-parallel over the tensor-parallel ranks (`mm_encoder_tp_mode="data"`).

The tower's weights are whole on every rank (small next to the text stack). A step's packed
items (images, or a video's frames as one item) are split into `tp_size` contiguous groups
of about equal token counts; each rank encodes its group, and one all-gather of the padded
outputs (main embeddings and Qwen3-VL's deepstack levels stacked together) gives every rank
all of them, in item order. Every rank knows every group's size from the grids, which all
ranks hold, so no sizes travel.

NOTE: with fewer items than ranks the step runs the tower whole on every rank (no collective;
the decision is the same everywhere since the grids are).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...mapping import Mapping
from ..distributed import all_gather

TowerFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]


def split_items(tokens: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous item ranges [a, b), one per part, none empty, about equal in tokens."""
    if len(tokens) < parts:
        raise ValueError(f"{len(tokens)} items cannot fill {parts} parts")
    total = sum(tokens)
    bounds = [0]
    running = 0
    for i, n in enumerate(tokens):
        running += n
        # Close a part once it reaches its share, leaving at least one item per later part.
        left_items = len(tokens) - (i + 1)
        left_parts = parts - len(bounds)
        if left_parts > 0 and (running * parts >= total * len(bounds) or left_items == left_parts):
            bounds.append(i + 1)
    bounds.append(len(tokens))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def check_same_items(kind: str, tokens: list[int], mapping: Mapping, device: torch.device) -> None:
    """Raise on every rank unless every rank is about to encode the same `kind` items (their
    vision token counts, in order): the ranks skip cached items by their own caches
    (vision_embedding_cache.py), and a rank that planned other items would pair its tower's
    all-gather with another rank's, or wait in it forever. One small all-gather per media
    step."""
    if mapping.tp_size == 1:
        return
    # gloo gathers host tensors, NCCL device ones; a media step reads its grids on the host.
    wire = device if device.type == "cuda" else torch.device("cpu")
    digest = [len(tokens), sum(tokens), sum(i * n for i, n in enumerate(tokens, 1))]
    gathered = all_gather(torch.tensor(digest, dtype=torch.int64, device=wire), mapping, dim=0)
    seen = gathered.reshape(mapping.tp_size, -1).tolist()
    if any(row != seen[0] for row in seen):
        raise RuntimeError(
            f"the tensor-parallel ranks planned different {kind} items to encode "
            f"(items, tokens, checksum per rank: {seen}): their vision embedding caches "
            f"diverged"
        )


def run_tower_data_parallel(
    run_tower: TowerFn,
    pixels: torch.Tensor,
    grid_thw: torch.Tensor,
    merge: int,
    mapping: Mapping,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`run_tower(pixels, grid_thw)`'s result, each rank encoding its share of the items."""
    grid = grid_thw.cpu().reshape(-1, 3)
    rows = [int(n) for n in grid.prod(dim=-1).tolist()]  # pixel rows per item
    tokens = [n // merge**2 for n in rows]
    if len(rows) < mapping.tp_size:
        return run_tower(pixels, grid_thw)
    ranges = split_items(tokens, mapping.tp_size)
    first, last = ranges[mapping.tp_rank]
    pixel_start = sum(rows[:first])
    mine = pixels[pixel_start : pixel_start + sum(rows[first:last])]
    main, levels = run_tower(mine, grid_thw[first:last])
    counts = [sum(tokens[a:b]) for a, b in ranges]
    width = max(counts)
    local = torch.stack([main, *levels])  # [1 + L, my tokens, D]
    padded = local.new_zeros(local.shape[0], width, local.shape[2])
    padded[:, : local.shape[1]] = local
    gathered = all_gather(padded, mapping, dim=1)  # [1 + L, tp * width, D]
    parts = [gathered[:, r * width : r * width + n] for r, n in enumerate(counts)]
    full = torch.cat(parts, dim=1)
    return full[0], list(full[1:])
