"""One modality's vision-tower work of a step, with prefix caching in mind.

Without a prefix hit or an embedding cache every item of every request runs through one packed
tower call, as always. With them, each item of a request is one of:
- skipped: all its placeholder runs end inside the request's cached prefix (the KV of those
  tokens is reused, so nothing reads its embeddings);
- served by the `VisionEmbeddingCache` (same content hash seen before, e.g. its KV evicted, or
  the hit ends inside it: the tower needs the whole image, the chunk slices what it needs);
- encoded: packed with the step's other misses into one tower call, then cached.
A request's stored embeddings start at its first kept item; the number of vision tokens of the
skipped items goes with them (`cached_embeddings[kind] = (main, deepstack, skipped)`) and
`chunk_embeddings` subtracts it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...inputs.media_hash import MULTIMODAL_HASHES
from ...inputs.multimodal import MultimodalParams
from .vision_embedding_cache import VisionEmbeddingCache

TowerFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]
# Tensor parallelism: raises unless every rank plans the same items (their token counts).
CheckItems = Callable[[list[int]], None]


@dataclass
class _Plan:
    """One request's items of the modality: which are skipped, cached or to encode."""

    skipped_tokens: int = 0
    # Per kept item, in prompt order: its cached (main, deepstack) or None (to encode).
    kept: list[tuple[torch.Tensor, list[torch.Tensor]] | None] = field(default_factory=list)
    # Per item to encode: (pixel rows, grid row, content hash or None).
    todo: list[tuple[torch.Tensor, torch.Tensor, bytes | None]] = field(default_factory=list)


def _item_ends(params: MultimodalParams, kind: str, counts: list[int]) -> list[int] | None:
    """The end of each item's last placeholder run (runs are taken in prompt order until they
    add up to the item's token count), or None when the spans do not add up."""
    spans = params.spans(kind)
    if spans is None:
        return None
    ends: list[int] = []
    runs = list(zip(spans[0].tolist(), spans[1].tolist(), strict=True))
    cursor = 0
    for count in counts:
        end = 0
        while count > 0 and cursor < len(runs):
            start, length = runs[cursor]
            end, count, cursor = start + length, count - length, cursor + 1
        if count != 0:
            return None
        ends.append(end)
    return ends


def _plan(
    params: MultimodalParams,
    kind: str,
    pixels: torch.Tensor,
    grid: torch.Tensor,
    merge: int,
    cache: VisionEmbeddingCache | None,
) -> _Plan:
    sizes = [int(n) for n in grid.prod(dim=-1).tolist()]
    counts = [n // merge**2 for n in sizes]
    hit = params.runtime.num_prefix_hit_tokens if params.runtime is not None else 0
    ends = _item_ends(params, kind, counts) if hit else None
    hashes: Sequence[str] = (params.get(MULTIMODAL_HASHES) or {}).get(kind) or ()
    plan = _Plan()
    rows = pixels.split(sizes)
    for i, (item_rows, count) in enumerate(zip(rows, counts, strict=True)):
        if ends is not None and ends[i] <= hit and not plan.kept:
            plan.skipped_tokens += count  # only leading items: the kept ones stay contiguous
            continue
        key = bytes.fromhex(hashes[i]) if i < len(hashes) else None
        entry = cache.get(key) if cache is not None and key is not None else None
        if entry is not None:
            plan.kept.append((entry.embeddings, list(entry.deepstack)))
        else:
            plan.kept.append(None)
            plan.todo.append((item_rows, grid[i : i + 1], key))
    return plan


def encode_modality(
    run_tower: TowerFn,
    owners: Sequence[MultimodalParams],
    kind: str,
    pix_key: str,
    grid_key: str,
    merge: int,
    dtype: torch.dtype,
    cache: VisionEmbeddingCache | None,
    check_items: CheckItems | None = None,
) -> None:
    """Set `cached_embeddings[kind]` of every owner (their dicts exist already).
    `check_items` (tensor parallelism) sees the token counts of the items to encode, before
    the tower runs (every media step, so a rank that planned alone fails here, not in the
    tower's all-gather)."""
    grids = [params.get(f"{kind}.{grid_key}").cpu().reshape(-1, 3) for params in owners]
    hits = any(p.runtime is not None and p.runtime.num_prefix_hit_tokens for p in owners)
    if cache is None and not hits:
        if check_items is not None:
            check_items([int(n) // merge**2 for g in grids for n in g.prod(dim=-1).tolist()])
        _encode_all(run_tower, owners, kind, pix_key, grids, merge, dtype)
        return
    plans = [
        _plan(p, kind, p.get(f"{kind}.{pix_key}"), grid, merge, cache)
        for p, grid in zip(owners, grids, strict=True)
    ]
    todo = [item for plan in plans for item in plan.todo]
    if check_items is not None:
        check_items([int(g.prod()) // merge**2 for _, g, _ in todo])
    outputs: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    if todo:
        pixels = torch.cat([rows for rows, _, _ in todo]).to(dtype)
        main, stack = run_tower(pixels, torch.cat([g for _, g, _ in todo]))
        counts = [int(g.prod()) // merge**2 for _, g, _ in todo]
        mains, stacks = main.split(counts), [level.split(counts) for level in stack]
        for i, (_, _, key) in enumerate(todo):
            levels = [lvl[i] for lvl in stacks]
            if cache is not None and key is not None:
                cache.put(key, mains[i], levels)
            outputs.append((mains[i], levels))
    fresh = iter(outputs)
    for params, plan in zip(owners, plans, strict=True):
        items = [item if item is not None else next(fresh) for item in plan.kept]
        store: dict[str, Any] = params.cached_embeddings  # type: ignore[assignment]
        store[kind] = (*_join(items), plan.skipped_tokens)


def _join(
    items: list[tuple[torch.Tensor, list[torch.Tensor]]],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One (main, deepstack) of a request's kept items, in order (no copy for a single one)."""
    if len(items) == 1:
        return items[0]
    if not items:  # every item skipped: nothing of this modality is read again
        return torch.empty(0), []
    main = torch.cat([m for m, _ in items])
    levels = len(items[0][1])
    return main, [torch.cat([s[level] for _, s in items]) for level in range(levels)]


def _encode_all(
    run_tower: TowerFn,
    owners: Sequence[MultimodalParams],
    kind: str,
    pix_key: str,
    grids: list[torch.Tensor],
    merge: int,
    dtype: torch.dtype,
) -> None:
    """Every item of every owner in one packed tower call (no reuse in play)."""
    pixels = torch.cat([p.get(f"{kind}.{pix_key}") for p in owners]).to(dtype)
    main, stack = run_tower(pixels, torch.cat(grids))
    counts = [int(g.prod(dim=-1).sum()) // merge**2 for g in grids]
    mains = main.split(counts)
    stacks = [level.split(counts) for level in stack]
    for i, params in enumerate(owners):
        store: dict[str, Any] = params.cached_embeddings  # type: ignore[assignment]
        store[kind] = (mains[i], [lvl[i] for lvl in stacks], 0)
