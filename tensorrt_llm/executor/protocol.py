"""Messages between the front end (`GenerationExecutorProxy`) and the engine process.

To the engine: (MSG_REQUEST, RequestMsg), (MSG_CANCEL, request_id), (MSG_SHUTDOWN, wait).
To the front end: (MSG_READY, EngineInfo) or (MSG_ERROR, ...) once at startup, then
(MSG_STEP, [response tuple, ...], stats dict) once per executor step, and (MSG_STOPPED, stats
dict) after a shutdown command.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._torch.pyexecutor.llm_request import LlmRequest
from .._torch.pyexecutor.py_executor import LlmResponse
from ..inputs.multimodal import MultimodalParams
from ..sampling_params import SamplingParams

# (modality, key) of the pixel tensors in `multimodal_data`.
PIXEL_KEYS = (("image", "pixel_values"), ("video", "pixel_values_videos"))

MSG_REQUEST = "request"
MSG_CANCEL = "cancel"
MSG_SHUTDOWN = "shutdown"
MSG_READY = "ready"
MSG_ERROR = "error"
MSG_STEP = "step"
MSG_STOPPED = "stopped"


@dataclass
class RequestMsg:
    """One request as sent to the engine: token ids and preprocessed multimodal tensors."""

    request_id: int
    prompt_token_ids: np.ndarray  # int64 [L]; pickled out of band
    sampling_params: SamplingParams
    multimodal_data: dict[str, Any] | None
    scheduling_group: Hashable | None
    cache_salt: str | None = None

    @classmethod
    def from_llm_request(
        cls, request: LlmRequest, pixel_dtype: torch.dtype | None = None
    ) -> RequestMsg:
        """pixel_dtype: the engine's patch-embedding dtype; pixels are cast to it here."""
        mm = request.multimodal_params
        data = mm.multimodal_data if mm is not None else None
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_array,
            sampling_params=request.sampling_params,
            multimodal_data=narrow_pixels(data, pixel_dtype) if data else data,
            scheduling_group=request.scheduling_group,
            cache_salt=request.cache_salt,
        )

    def to_llm_request(self) -> LlmRequest:
        mm = MultimodalParams(self.multimodal_data) if self.multimodal_data else None
        request = LlmRequest(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            mm,
            scheduling_group=self.scheduling_group,
        )
        request.cache_salt = self.cache_salt
        return request


def narrow_pixels(data: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """`data` with its pixel tensors cast to `dtype` (dicts copied where changed, never
    mutated).

    NOTE: bit-identical for the model: the patch embedding casts pixels to its weight dtype
    before anything else (PatchEmbed.forward). Doing it before the IPC halves the bytes that a
    bf16 engine's fp32 pixels take through shared memory.
    """
    if dtype is None:
        return data
    out = dict(data)
    for modality, key in PIXEL_KEYS:
        inner = out.get(modality)
        if isinstance(inner, dict) and isinstance(inner.get(key), torch.Tensor):
            out[modality] = {**inner, key: inner[key].to(dtype)}
    return out


def response_to_tuple(r: LlmResponse) -> tuple[Any, ...]:
    # Tuples pickle smaller and faster than dataclass instances (one per request per step).
    return (
        r.request_id,
        r.new_token_ids,
        r.finished,
        r.finish_reason,
        r.stop_reason,
        r.error,
        r.error_code,
        r.new_logprobs,
        r.prompt_logprobs,
        r.num_cached_tokens,
        r.metrics,
    )


def response_from_tuple(t: tuple[Any, ...]) -> LlmResponse:
    return LlmResponse(*t)


@dataclass(frozen=True)
class KvLimits:
    """The fixed sizes of the engine's KV cache that `SimpleScheduler.validate` reads."""

    num_blocks: int
    tokens_per_block: int
    max_tokens_per_seq: int

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)


@dataclass(frozen=True)
class EngineInfo:
    """What the engine reports once at startup; the front end answers limits from it."""

    pid: int
    max_seq_len: int
    vocab_size: int
    max_batch_size: int
    max_num_tokens: int
    enable_chunked_prefill: bool
    kv_limits: KvLimits
    stats: dict[str, Any]
    pixel_dtype: torch.dtype | None = None  # the patch embedding's; None: no vision tower

    @classmethod
    def from_executor(cls, executor: Any, pid: int) -> EngineInfo:
        from dataclasses import asdict

        scheduler = executor.scheduler
        kv = executor.kv_cache_manager
        vocab = getattr(executor.model_engine, "vocab_size", 0) or executor.sampler.vocab_size
        return cls(
            pid=pid,
            max_seq_len=executor.max_seq_len,
            vocab_size=int(vocab),
            max_batch_size=scheduler.max_batch_size,
            max_num_tokens=scheduler.max_num_tokens,
            enable_chunked_prefill=scheduler.enable_chunked_prefill,
            kv_limits=KvLimits(kv.num_blocks, kv.tokens_per_block, kv.max_tokens_per_seq),
            stats=asdict(executor.get_stats()),
            pixel_dtype=_patch_embed_dtype(executor.model_engine.model),
        )


def _patch_embed_dtype(model: torch.nn.Module) -> torch.dtype | None:
    from .._torch.models.modeling_qwen_vision_common import PatchEmbed

    for module in model.modules():
        if isinstance(module, PatchEmbed):
            return module.proj.weight.dtype
    return None
