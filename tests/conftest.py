"""Shared pytest setup: the `gpu` marker skips without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels run through the interpreter (tiny sizes in tests). It must be
# set before any kernel module is imported, which conftest import order guarantees.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _numpy_scalar_index_shim() -> None:
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a loop bound
    with `int(array)`, which numpy >= 2.4 rejects; index through `reshape(-1)[0]` instead.
    Test harness only: compiled kernels never go through the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_shim", False):
        return

    def patched(tensor: type, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        )

    patched._scalar_index_shim = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


_numpy_scalar_index_shim()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
