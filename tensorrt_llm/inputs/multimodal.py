"""MultimodalParams: the per-request multimodal payload and its selective device moves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._utils import maybe_pin_memory

MROPE_POSITION_IDS = "mrope_config.mrope_position_ids"
MROPE_POSITION_DELTAS = "mrope_config.mrope_position_deltas"


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


@dataclass
class MultimodalRuntimeData:
    """Which vision tokens of a request the current prefill chunk covers, per modality.

    Set by the engine each step (host ints): the chunk holds image tokens
    [num_cached_image_tokens, num_cached_image_tokens + num_image_tokens_in_chunk), likewise video.
    """

    num_cached_image_tokens: int = 0
    num_image_tokens_in_chunk: int = 0
    num_cached_video_tokens: int = 0
    num_video_tokens_in_chunk: int = 0


@dataclass
class MultimodalParams:
    """Multimodal tensors of one request, keyed by modality.

    Layout of `multimodal_data`:
      image: {pixel_values, image_grid_thw}
      video: {pixel_values_videos, video_grid_thw, second_per_grid_ts?}
      multimodal_embedding: precomputed vision embeddings (optional)
      mrope_config: {mrope_position_ids int64 [3,1,L], mrope_position_deltas int32 [1,1]}
    """

    multimodal_data: dict[str, Any] = field(default_factory=dict)
    runtime: MultimodalRuntimeData | None = None
    # Vision-tower outputs kept across prefill chunks of one request (set by the model).
    cached_embeddings: dict[str, Any] | None = None

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

    def strip_for_generation(self) -> None:
        """Drop everything but the mRoPE delta once the context phase is over."""
        self.cached_embeddings = None
        self.runtime = None
        parent, leaf = _get_path(self.multimodal_data, MROPE_POSITION_DELTAS)
        if parent is None:
            self.multimodal_data = {}
            return
        self.multimodal_data = {"mrope_config": {"mrope_position_deltas": parent[leaf]}}

    def has_content(self) -> bool:
        return bool(self.multimodal_data)

    def get(self, path: str, default: Any = None) -> Any:
        """Read a dotted path such as `image.pixel_values`."""
        parent, leaf = _get_path(self.multimodal_data, path)
        return default if parent is None else parent[leaf]
