"""Checks of one request's multimodal payload, run once before its first prefill chunk.

They run on the host, before the step touches any state, so a failure is a
`RequestInputError` that fails this request alone (see request_errors.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ...inputs.multimodal import (
    MROPE_POSITION_DELTAS,
    MROPE_POSITION_IDS,
    SPAN_MODALITIES,
    MultimodalParams,
)
from .llm_request import LlmRequest
from .request_errors import RequestInputError


def check_multimodal_request(req: LlmRequest) -> None:
    """mRoPE positions and delta present and shaped for the prompt; every placeholder span
    inside the prompt, sorted and disjoint; spans and media data present together."""
    params = req.multimodal_params
    rid = req.request_id
    if params is None:
        raise RequestInputError([rid], "no multimodal params (mRoPE model)")
    pos = params.get(MROPE_POSITION_IDS)
    if not isinstance(pos, torch.Tensor) or tuple(pos.shape) != (3, 1, req.prompt_len):
        shape = tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise RequestInputError(
            [rid], f"mrope_position_ids must be [3, 1, {req.prompt_len}], got {shape}"
        )
    if params.get(MROPE_POSITION_DELTAS) is None:
        raise RequestInputError([rid], "no mrope_config.mrope_position_deltas")
    for kind in SPAN_MODALITIES:
        try:
            spans = params.spans(kind)
        except ValueError as exc:
            raise RequestInputError([rid], str(exc)) from exc
        has_data = params.get(kind) is not None
        if spans is None or spans[0].size == 0:
            if has_data:
                raise RequestInputError([rid], f"{kind} data but no {kind} placeholder spans")
            continue
        if not has_data:
            raise RequestInputError([rid], f"{kind} placeholder spans but no {kind} data")
        _check_spans(rid, kind, spans[0], spans[1], req.prompt_len)
    _check_disjoint_modalities(req, params)


def _check_spans(
    rid: int, kind: str, starts: np.ndarray, lengths: np.ndarray, prompt_len: int
) -> None:
    if starts.shape != lengths.shape:
        raise RequestInputError([rid], f"{kind} span positions and lengths differ in count")
    stops = starts + lengths
    if (lengths <= 0).any() or (starts < 0).any() or (stops > prompt_len).any():
        raise RequestInputError(
            [rid], f"{kind} placeholder spans must lie inside the {prompt_len}-token prompt"
        )
    if (starts[1:] < stops[:-1]).any():
        raise RequestInputError([rid], f"{kind} placeholder spans must be sorted and disjoint")


def _check_disjoint_modalities(req: LlmRequest, params: MultimodalParams) -> None:
    """An image span and a video span may not cover the same prompt position (`params` is
    the request's own, already checked present)."""
    image, video = params.spans("image"), params.spans("video")
    if image is None or video is None or not image[0].size or not video[0].size:
        return
    covered = np.zeros(req.prompt_len, dtype=np.int8)
    for starts, lengths in (image, video):
        for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            covered[start : start + length] += 1
    if (covered > 1).any():
        raise RequestInputError([req.request_id], "image and video placeholder spans overlap")
