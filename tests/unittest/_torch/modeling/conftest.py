"""Fixtures shared by the input-processor test modules: tiny checkpoints and their processors.

Session-scoped so the two processor modules build them once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from processor_test_helpers import FAMILIES

from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_checkpoint(f, root / f) for f in (*FAMILIES, "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def procs(ckpts: dict[str, Path]) -> dict[str, Any]:
    return {f: create_input_processor(ckpts[f]) for f in FAMILIES}
