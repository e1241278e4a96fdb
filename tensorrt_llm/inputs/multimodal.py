"""MultimodalParams: the per-request multimodal payload and its selective device moves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._utils import maybe_pin_memory

MROPE_POSITION_IDS = "mrope_config.mrope_position_ids"
MROPE_POSITION_DELTAS = "mrope_config.mrope_position_deltas"
# Placeholder spans of each modality (TensorRT-LLM's names): `multimodal_data[KEY][kind]` is an
# int64 host tensor [n], one entry per run of vision tokens, in prompt order. They stay on the
# host (no device path lists them): the engine turns them into step rows with numpy.
MULTIMODAL_POSITIONS = "multimodal_positions"
MULTIMODAL_LENGTHS = "multimodal_lengths"
SPAN_MODALITIES = ("image", "video")


def _get_path(data: dict[str, Any], path: str) -> tuple[dict[str, Any] | None, str]:
    """Return the dict that holds the last key of a dotted path (or None when missing)."""
    *parents, leaf = path.split(".")
    node: Any = data
    for key in parents:
        if not isinstance(node, dict) or key not in node:
            return None, leaf
        node = node[key]
    if not isinstance(node, dict) or leaf not in node:
        return None, leaf
    return node, leaf


def _move(value: Any, device: torch.device, pin_memory: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        if pin_memory and value.device.type == "cpu":
            value = maybe_pin_memory(value)
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: _move(v, device, pin_memory) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_move(v, device, pin_memory) for v in value)
    return value


def _copy_tree(value: Any) -> Any:
    """New dicts and lists all the way down, the same tensors at the leaves: `to_device`
    replaces leaves in place, which must not reach a copy."""
    if isinstance(value, dict):
        return {k: _copy_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy_tree(v) for v in value)
    return value


def placeholder_spans(ids: Any, token_id: int) -> tuple[list[int], list[int]]:
    """(starts, lengths) of the runs of `token_id` in `ids`.

    For code that builds `multimodal_data` itself from a prompt it just expanded (input
    processing time). NOTE: never call it on step tokens: a sampled token may equal a pad id.
    """
    hits = np.concatenate([[0], (np.asarray(ids, dtype=np.int64) == token_id).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(hits))
    starts, ends = edges[0::2], edges[1::2]
    return starts.tolist(), (ends - starts).tolist()


def spans_data(spans: dict[str, tuple[list[int], list[int]]]) -> dict[str, Any]:
    """`{MULTIMODAL_POSITIONS: {kind: [n]}, MULTIMODAL_LENGTHS: {kind: [n]}}` (int64, host)."""
    positions = {k: torch.tensor(s, dtype=torch.int64) for k, (s, _) in spans.items() if s}
    lengths = {k: torch.tensor(n, dtype=torch.int64) for k, (s, n) in spans.items() if s}
    return {MULTIMODAL_POSITIONS: positions, MULTIMODAL_LENGTHS: lengths}


def chunk_rows(
    starts: np.ndarray, lengths: np.ndarray, begin: int, end: int
) -> tuple[int, np.ndarray]:
    """Vision tokens of the spans before `begin`, and the chunk-relative rows of those in
    [begin, end) (int64, ascending), for the prefill chunk [begin, end)."""
    stops = starts + lengths
    cached = int(np.clip(np.minimum(stops, begin) - starts, 0, None).sum())
    lo = np.maximum(starts, begin)
    hi = np.minimum(stops, end)
    keep = hi > lo
    lo, sizes = lo[keep], (hi - lo)[keep]
    # concat(arange(lo_i, hi_i)) without a Python loop: each run's offset minus its start.
    first = np.cumsum(sizes) - sizes
    rows = np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(lo - first - begin, sizes)
    return cached, rows


@dataclass
class MultimodalRuntimeData:
    """Which vision tokens of a request the current prefill chunk covers, per modality.

    Set by the engine each step from the request's placeholder spans: the chunk holds image
    tokens [num_cached_image_tokens, num_cached_image_tokens + num_image_tokens_in_chunk),
    likewise video, and `image_rows` / `video_rows` ([n] int64, on the step's device) are the
    rows of the step's token batch they go to.
    """

    num_cached_image_tokens: int = 0
    num_image_tokens_in_chunk: int = 0
    num_cached_video_tokens: int = 0
    num_video_tokens_in_chunk: int = 0
    image_rows: torch.Tensor | None = None
    video_rows: torch.Tensor | None = None
    request_id: int | None = None  # names the request in input errors
    # Prompt tokens of the request's cached prefix (KV block reuse): items whose placeholder
    # runs all end by then are not encoded.
    num_prefix_hit_tokens: int = 0


@dataclass
class MultimodalParams:
    """Multimodal tensors of one request, keyed by modality.

    Layout of `multimodal_data`:
      image: {pixel_values, image_grid_thw}
      video: {pixel_values_videos, video_grid_thw, second_per_grid_ts?}
      multimodal_embedding: precomputed vision embeddings (optional)
      mrope_config: {mrope_position_ids int64 [3,1,L], mrope_position_deltas int32 [1,1]}
      multimodal_positions / multimodal_lengths: {image?: int64 [n], video?: int64 [n]}, the
        placeholder spans (host; see MULTIMODAL_POSITIONS)
    """

    multimodal_data: dict[str, Any] = field(default_factory=dict)
    runtime: MultimodalRuntimeData | None = None
    # Vision-tower outputs kept across prefill chunks of one request (set by the model).
    cached_embeddings: dict[str, Any] | None = None
    # The payload as it was before its first device move: a preempted request is prefilled
    # again from it (`keep_for_recompute`, `restore_for_recompute`). Host tensors only, shared
    # with the original, so it costs no copy; it holds the host pixels for the request's life.
    _recompute_data: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def to_device(
        self,
        element: str,
        device: torch.device | str,
        pin_memory: bool = False,
        target_keywords: list[str] | None = None,
    ) -> None:
        """Move tensors under `self.<element>` to `device`, in place.

        With `target_keywords` only those dotted paths move (missing ones are skipped and
        unlisted tensors stay where they are); with None everything moves.
        """
        data = getattr(self, element)
        device = torch.device(device)
        if target_keywords is None:
            setattr(self, element, _move(data, device, pin_memory))
            return
        for path in target_keywords:
            parent, leaf = _get_path(data, path)
            if parent is not None:
                parent[leaf] = _move(parent[leaf], device, pin_memory)

    def keep_for_recompute(self) -> None:
        """Remember the payload's structure and tensors before a device move (idempotent)."""
        if self._recompute_data is None:
            self._recompute_data = _copy_tree(self.multimodal_data)

    def restore_for_recompute(self) -> None:
        """Back to the payload `keep_for_recompute` saw, for a prefill from position 0."""
        self.cached_embeddings = None
        self.runtime = None
        if self._recompute_data is not None:
            self.multimodal_data = _copy_tree(self._recompute_data)

    def strip_for_generation(self) -> None:
        """Drop everything but the mRoPE delta once the context phase is over."""
        self.cached_embeddings = None
        self.runtime = None
        parent, leaf = _get_path(self.multimodal_data, MROPE_POSITION_DELTAS)
        if parent is None:
            self.multimodal_data = {}
            return
        self.multimodal_data = {"mrope_config": {"mrope_position_deltas": parent[leaf]}}

    def spans(self, kind: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(starts, lengths) int64 numpy arrays of `kind`'s placeholder spans, or None."""
        starts = self.get(f"{MULTIMODAL_POSITIONS}.{kind}")
        lengths = self.get(f"{MULTIMODAL_LENGTHS}.{kind}")
        if starts is None and lengths is None:
            return None
        if starts is None or lengths is None:
            raise ValueError(f"{kind} placeholder spans need both positions and lengths")
        return _host_ints(starts, f"{MULTIMODAL_POSITIONS}.{kind}"), _host_ints(
            lengths, f"{MULTIMODAL_LENGTHS}.{kind}"
        )

    def has_content(self) -> bool:
        return bool(self.multimodal_data)

    def get(self, path: str, default: Any = None) -> Any:
        """Read a dotted path such as `image.pixel_values`."""
        parent, leaf = _get_path(self.multimodal_data, path)
        return default if parent is None else parent[leaf]


def _host_ints(value: Any, name: str) -> np.ndarray:
    array = value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D sequence of ints")
    return array.astype(np.int64, copy=False)
