"""Attention backends, looked up by name through a small registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .interface import AttentionMetadata
from .vanilla import VanillaAttention

# name -> backend class, built as cls(num_heads, num_kv_heads, head_dim, layer_idx, scale)
ATTENTION_BACKENDS: dict[str, Callable[..., Any]] = {"vanilla": VanillaAttention}
# Lazy: importing the package must not need triton; the module loads on first construction.
ATTENTION_BACKENDS["triton"] = lambda *a, **kw: __import__(
    f"{__name__}.triton", fromlist=["_"]
).TritonAttention(*a, **kw)
# Optional: needs the flash-attn package, checked when a layer is built.
ATTENTION_BACKENDS["flash_attn"] = lambda *a, **kw: __import__(
    f"{__name__}.flash_attn", fromlist=["_"]
).FlashAttnAttention(*a, **kw)


def register_attention_backend(name: str, cls: Callable[..., Any]) -> None:
    if name in ATTENTION_BACKENDS and ATTENTION_BACKENDS[name] is not cls:
        raise ValueError(f"attention backend {name!r} is already registered")
    ATTENTION_BACKENDS[name] = cls


def get_attention_backend(name: str) -> Callable[..., Any]:
    """Return the backend class registered as `name` (for example "vanilla")."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}"
        ) from None


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "VanillaAttention",
    "get_attention_backend",
    "register_attention_backend",
]
