"""The LLM API: `LLM`, its arguments and its outputs (imported lazily)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..sampling_params import GuidedDecodingParams, SamplingParams
    from .errors import PromptTooLongError
    from .llm import LLM
    from .llm_args import CudaGraphConfig, LlmArgs, MTPDecodingConfig, TorchLlmArgs
    from .logprobs import Logprob, TokenLogprobs
    from .outputs import CompletionOutput, RequestOutput
    from .result import GenerationResult
    from .scheduler_args import CapacitySchedulerPolicy, SchedulerConfig
    from .upstream_args import KvCacheConfig

_LAZY: dict[str, str] = {
    "LLM": ".llm",
    "LlmArgs": ".llm_args",
    "CudaGraphConfig": ".llm_args",
    "KvCacheConfig": ".upstream_args",
    "SchedulerConfig": ".scheduler_args",
    "CapacitySchedulerPolicy": ".scheduler_args",
    "MTPDecodingConfig": ".llm_args",
    "TorchLlmArgs": ".llm_args",
    "RequestOutput": ".outputs",
    "CompletionOutput": ".outputs",
    "Logprob": ".logprobs",
    "TokenLogprobs": ".logprobs",
    "GenerationResult": ".result",
    "PromptTooLongError": ".errors",
    "SamplingParams": "..sampling_params",
    "GuidedDecodingParams": "..sampling_params",
}

__all__ = [
    "LLM",
    "LlmArgs",
    "CudaGraphConfig",
    "KvCacheConfig",
    "SchedulerConfig",
    "CapacitySchedulerPolicy",
    "MTPDecodingConfig",
    "TorchLlmArgs",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "TokenLogprobs",
    "GenerationResult",
    "PromptTooLongError",
    "SamplingParams",
    "GuidedDecodingParams",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorrt_llm.llmapi' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
