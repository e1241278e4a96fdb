"""The vision side of a Qwen-VL model: what it uses of a tower, how HF VL checkpoints split
into text and vision weights, and which cached embeddings a prefill chunk takes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from ...inputs.multimodal import MultimodalParams
from ..input_errors import RequestInputError

if TYPE_CHECKING:
    from ...inputs.multimodal import MultimodalRuntimeData
    from .modeling_qwen_vision_common import VisionTowerOutput

MODALITIES = (
    ("image", "pixel_values", "image_grid_thw"),
    ("video", "pixel_values_videos", "video_grid_thw"),
)


def chunk_embeddings(
    params: MultimodalParams, kind: str
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
    """(step rows, main embeddings, deepstack embeddings) of `kind` for the request's chunk,
    or None when the chunk has none; a RequestInputError when the counts disagree."""
    # `_merge_vision` passes only params that have runtime data.
    runtime = cast("MultimodalRuntimeData", params.runtime)
    begin = getattr(runtime, f"num_cached_{kind}_tokens")
    count = getattr(runtime, f"num_{kind}_tokens_in_chunk")
    if count == 0:
        return None
    rid = [runtime.request_id]
    embeds = params.cached_embeddings or {}
    if kind not in embeds:
        raise RequestInputError(rid, f"prompt has {kind} placeholder tokens but no {kind} data")
    # `skipped`: vision tokens of leading items inside the prefix hit, never encoded.
    main, stack, skipped = embeds[kind]
    spans = params.spans(kind)
    total = int(spans[1].sum()) - skipped if spans is not None else -1
    if total != main.shape[0]:
        raise RequestInputError(
            rid,
            f"the prompt has {total} {kind} placeholder tokens but the {kind} data gives "
            f"{main.shape[0]} embeddings",
        )
    index = getattr(runtime, f"{kind}_rows")
    if index is None or index.shape[0] != count:
        raise RequestInputError(rid, f"{kind} rows of the chunk do not match its span count")
    begin -= skipped
    if begin < 0:
        raise RequestInputError(rid, f"{kind} chunk starts inside an item that was skipped")
    return index, main[begin : begin + count], [d[begin : begin + count] for d in stack]


def split_vl_weights(
    weights: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split HF VL weights into (text LLM names `model.*`/`lm_head.*`, vision names).

    Accepts the transformers-5 layout (`model.language_model.*`, `model.visual.*`) and the hub
    layout (`model.*`, `visual.*`).
    """
    text: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith("model.visual."):
            vision[name[len("model.visual.") :]] = tensor
        elif name.startswith("visual."):
            vision[name[len("visual.") :]] = tensor
        elif name.startswith("model.language_model."):
            text["model." + name[len("model.language_model.") :]] = tensor
        else:
            text[name] = tensor
    return text, vision


class VisionTower(Protocol):
    """What the model uses of a vision tower (`Qwen2VisionModel`, `Qwen3VisionModel`, ...)."""

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionTowerOutput: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None: ...
