"""TensorRT-LLM PyTorch-backend path for the Qwen-VL family.

Public names are imported lazily, so `import tensorrt_llm` stays cheap (no model code loads
until `tensorrt_llm.LLM` is first touched).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .llmapi.llm import LLM
    from .llmapi.outputs import CompletionOutput, RequestOutput
    from .sampling_params import GuidedDecodingParams, SamplingParams

try:  # TensorRT-LLM's name; trtllm-serve's /version answers it
    __version__ = importlib.metadata.version("tensorrt-llm-qwenvl")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

_LAZY: dict[str, str] = {
    "LLM": ".llmapi.llm",
    "SamplingParams": ".sampling_params",
    "RequestOutput": ".llmapi.outputs",
    "CompletionOutput": ".llmapi.outputs",
    "GuidedDecodingParams": ".sampling_params",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "GuidedDecodingParams"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorrt_llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
