"""Content hashes of processed multimodal items, for prefix caching and the vision-embedding cache.

An item's hash names what the model sees of it: the processed pixel tensor (dtype, shape and
bytes), its grid (`image_grid_thw` / `video_grid_thw` row), a video's `second_per_grid_ts`
(it moves Qwen2.5-VL's temporal mRoPE positions) and the processor kwargs that were applied.
Hashing the processor's output, not the source file, makes two encodings of the same picture
(PNG vs. a data URL of it) hit, and the same file resized under other `min_pixels` miss.

Where the input processor hands over the decoded items it processed (`MULTIMODAL_SOURCES` in
its extra outputs: RGB PIL images, `VideoData` frames), those are hashed instead of the
processed pixels: the processor is a pure function of them, the grid and the kwargs, and their
uint8 bytes are a quarter to a twelfth of the float32 patches (Qwen3-VL's patches repeat each
pixel over the temporal patch), so a 512x512 image costs ~1 ms instead of ~5-8 ms on the
request's path to its first token.

Cost: SHA-256 runs at about 0.8-1.2 GB/s on one core (SHA-NI); a 1024x1024 image becomes 5476
patches x 1176 float32 values (25.8 MB) for Qwen2-VL, ~31 ms as processed pixels (blake2b took
~60 ms, hence SHA-256), ~4 ms as its 3 MB of decoded pixels. It runs on the host, in the
preprocessing workers where those are on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .multimodal import MULTIMODAL_LENGTHS, MULTIMODAL_POSITIONS

# Bumped whenever the encoding below changes.
_MEDIA_VERSION = b"trtllm-media-v1"

# modality -> (pixel key, grid key) in `multimodal_data[modality]` (multimodal.py's layout).
PIXEL_KEYS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}
# Where an input processor may put the decoded items it processed ({modality: [items]}, in the
# order of the processed rows); the input preparer takes them out before the request leaves.
MULTIMODAL_SOURCES = "multimodal_sources"
# Where the items' hashes go in `multimodal_data` (hex strings, one list per modality): plain
# data, so they cross the executor's process boundary like the placeholder spans do.
MULTIMODAL_HASHES = "multimodal_hashes"


def _tensor_bytes(h: Any, tensor: torch.Tensor) -> None:
    """dtype, shape, then the raw bytes of a contiguous CPU copy."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h.update(str(t.dtype).encode())
    h.update(len(t.shape).to_bytes(1, "little"))
    for dim in t.shape:
        h.update(int(dim).to_bytes(8, "little"))
    # NOTE: a uint8 view reads the storage as is (bfloat16 has no numpy dtype).
    h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")


def _canonical_kwargs(kwargs: Mapping[str, Any] | None) -> bytes:
    """Sorted-key JSON: the same kwargs give the same bytes in any process or order."""
    if not kwargs:
        return b"{}"
    return json.dumps(dict(kwargs), sort_keys=True, separators=(",", ":"), default=str).encode()


def hash_multimodal_item(
    modality: str,
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor | Sequence[int],
    processor_kwargs: Mapping[str, Any] | None = None,
    second_per_grid: float | None = None,
) -> bytes:
    """32-byte digest of one processed item (one image, or one video).

    pixel_values: the item's own rows of the processor output (`split_pixel_rows`).
    processor_kwargs: the request's `mm_processor_kwargs` (resizing, frame sampling). Their
      effect is mostly visible in the pixels and grid already; they are mixed in so a knob
      whose effect is not (a future one) cannot make two different inputs collide.
    """
    h = hashlib.sha256(_MEDIA_VERSION)
    h.update(modality.encode() + b"\0")
    grid = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1)
    _tensor_bytes(h, grid)
    _tensor_bytes(h, pixel_values)
    h.update(_canonical_kwargs(processor_kwargs))
    h.update(b"-" if second_per_grid is None else repr(float(second_per_grid)).encode())
    return h.digest()


def _source_bytes(h: Any, item: Any) -> bool:
    """Feed a decoded item's pixels (and a video's timing) to `h`; False for an unknown kind."""
    from PIL import Image

    if isinstance(item, Image.Image):
        h.update(f"pil:{item.mode}:{item.width}x{item.height};".encode())
        h.update(item.tobytes())
        return True
    if isinstance(item, torch.Tensor):
        h.update(b"tensor;")
        _tensor_bytes(h, item)
        return True
    frames = getattr(item, "frames", None)  # VideoData (inputs/utils.py): frames + timing
    if isinstance(frames, list) and frames:
        h.update(f"video:{len(frames)}:{item.fps!r}:{item.timestamps!r};".encode())
        return all(_source_bytes(h, frame) for frame in frames)
    return False


def hash_source_item(
    modality: str,
    item: Any,
    grid_thw: torch.Tensor | Sequence[int],
    processor_kwargs: Mapping[str, Any] | None = None,
    second_per_grid: float | None = None,
) -> bytes | None:
    """32-byte digest of one item from its decoded source (None: a kind with no pixels here).

    Never equal to a `hash_multimodal_item` digest (another version tag): the two name the same
    item differently, and one engine always uses the same input processor."""
    h = hashlib.sha256(_MEDIA_VERSION + b"-source")
    h.update(modality.encode() + b"\0")
    _tensor_bytes(h, torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1))
    if not _source_bytes(h, item):
        return None
    h.update(_canonical_kwargs(processor_kwargs))
    h.update(b"-" if second_per_grid is None else repr(float(second_per_grid)).encode())
    return h.digest()


def split_pixel_rows(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    """Each item's rows of a modality's packed pixels (item i has prod(grid_thw[i]) patches)."""
    counts = [int(n) for n in torch.as_tensor(grid_thw).prod(dim=-1).tolist()]
    if sum(counts) != pixel_values.shape[0]:
        raise ValueError(
            f"grids give {sum(counts)} patches but pixel_values has {pixel_values.shape[0]} rows"
        )
    return list(pixel_values.split(counts))


def hash_multimodal_data(
    data: Mapping[str, Any],
    processor_kwargs: Mapping[str, Any] | None = None,
    sources: Mapping[str, Sequence[Any]] | None = None,
) -> dict[str, list[str]]:
    """Hex digests of every item in an input processor's `multimodal_data`, per modality.

    sources: the decoded items the processor processed (`MULTIMODAL_SOURCES`); a modality
      whose items are all there, one per processed item, is hashed from them (cheaper), else
      from the processed pixels.
    Items without pixels (e.g. precomputed `multimodal_embedding`) are not hashed here: they
    have no processed tensor to name them, and a request carrying them should not reuse KV.
    """
    out: dict[str, list[str]] = {}
    for modality, (pix_key, grid_key) in PIXEL_KEYS.items():
        entry = data.get(modality)
        if not isinstance(entry, Mapping) or entry.get(pix_key) is None:
            continue
        grids = torch.as_tensor(entry[grid_key]).reshape(-1, 3)
        seconds = entry.get("second_per_grid_ts")
        per_item = split_pixel_rows(entry[pix_key], grids)
        items = (sources or {}).get(modality)
        if items is not None and len(items) == len(per_item):
            digests = [
                hash_source_item(
                    modality,
                    item,
                    grids[i],
                    processor_kwargs,
                    None if seconds is None else float(seconds[i]),
                )
                for i, item in enumerate(items)
            ]
            if all(d is not None for d in digests):
                out[modality] = [d.hex() for d in digests if d is not None]
                continue
        out[modality] = [
            hash_multimodal_item(
                modality,
                pixels,
                grids[i],
                processor_kwargs,
                None if seconds is None else float(seconds[i]),
            ).hex()
            for i, pixels in enumerate(per_item)
        ]
    return out


def item_runs(
    data: Mapping[str, Any], modality: str, merge_size: int
) -> list[list[tuple[int, int]]]:
    """Each item's placeholder runs (start, length), from the spans and the grids.

    The spans list runs in prompt order without saying which item a run belongs to; an item
    owns runs until their lengths add up to its token count, prod(grid) / merge_size**2 (one
    run per image; one per video, or one per temporal patch with Qwen3-VL's timestamps).
    """
    entry = data.get(modality)
    positions = (data.get(MULTIMODAL_POSITIONS) or {}).get(modality)
    lengths = (data.get(MULTIMODAL_LENGTHS) or {}).get(modality)
    if not isinstance(entry, Mapping) or positions is None or lengths is None:
        return []
    grid_key = PIXEL_KEYS[modality][1]
    counts = [
        int(n) // merge_size**2
        for n in torch.as_tensor(entry[grid_key]).reshape(-1, 3).prod(dim=-1).tolist()
    ]
    starts, sizes = torch.as_tensor(positions).tolist(), torch.as_tensor(lengths).tolist()
    runs = list(zip(starts, sizes, strict=True))
    out: list[list[tuple[int, int]]] = []
    cursor = 0
    for count in counts:
        mine: list[tuple[int, int]] = []
        while count > 0 and cursor < len(runs):
            mine.append(runs[cursor])
            count -= runs[cursor][1]
            cursor += 1
        if count != 0:
            raise ValueError(f"{modality} placeholder runs do not add up to the items' tokens")
        out.append(mine)
    if cursor != len(runs):
        raise ValueError(f"{len(runs) - cursor} {modality} placeholder run(s) belong to no item")
    return out
