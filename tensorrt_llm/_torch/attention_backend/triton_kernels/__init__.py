"""Triton kernels of the `triton` attention backend: paged KV store, varlen prefill, decode."""

from __future__ import annotations

from .decode import paged_decode
from .kv_store import store_kv
from .prefill import paged_prefill

__all__ = ["paged_decode", "paged_prefill", "store_kv"]
