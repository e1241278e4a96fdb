"""Shared pytest setup: the `gpu` marker skips without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels run through the interpreter (tiny sizes in tests). It must be
# set before any kernel module is imported, which conftest import order guarantees.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
