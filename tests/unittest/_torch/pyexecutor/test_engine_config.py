"""EngineConfig: LlmArgs resolved once into the frozen config startup reads, and the engine
side never reaching back up into llmapi."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import tensorrt_llm
from tensorrt_llm._torch.pyexecutor.engine_config import CudaGraphConfig, EngineConfig
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm.llmapi import llm_args
from tensorrt_llm.llmapi.llm_args import DEFAULT_MAX_SEQ_LEN_CAP, LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

PYEXECUTOR = Path(tensorrt_llm.__file__).resolve().parent / "_torch" / "pyexecutor"


def _llmapi_imports(source: str, package: str) -> list[int]:
    """Lines of `source` (a module of `package`) that import from tensorrt_llm.llmapi, at any
    depth: module level, inside functions and under `if TYPE_CHECKING:` alike."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - (node.level - 1)] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            # `from tensorrt_llm import llmapi` imports the package by its name.
            names = [target, *(f"{target}.{a.name}" for a in node.names)]
        else:
            continue
        if any(n == "tensorrt_llm.llmapi" or n.startswith("tensorrt_llm.llmapi.") for n in names):
            lines.append(node.lineno)
    return lines


def test_the_import_checker_sees_every_form() -> None:
    pkg = "tensorrt_llm._torch.pyexecutor"
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ...llmapi import x\n"
    assert _llmapi_imports(guarded, pkg) == [3]
    assert _llmapi_imports("def f():\n    import tensorrt_llm.llmapi.llm_args\n", pkg) == [2]
    assert _llmapi_imports("from tensorrt_llm.llmapi.llm import LLM\n", pkg) == [1]
    assert _llmapi_imports("from ... import llmapi\n", pkg) == [1]
    assert _llmapi_imports("from ..models import llmapi\nfrom .llmapi_x import y\n", pkg) == []


def test_pyexecutor_never_imports_llmapi() -> None:
    found = []
    for path in sorted(PYEXECUTOR.rglob("*.py")):
        package = "tensorrt_llm._torch.pyexecutor"
        sub = path.parent.relative_to(PYEXECUTOR).parts
        package = ".".join([package, *sub])
        for line in _llmapi_imports(path.read_text(encoding="utf-8"), package):
            found.append(f"{path.relative_to(PYEXECUTOR.parent.parent)}:{line}")
    assert not found, "the engine reads EngineConfig, not llmapi: " + ", ".join(found)


def test_cuda_graph_config_is_one_class_for_users_and_the_engine() -> None:
    assert llm_args.CudaGraphConfig is CudaGraphConfig
    assert tensorrt_llm.llmapi.CudaGraphConfig is CudaGraphConfig


def test_cpu_args_resolve_once_into_a_frozen_config(tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen2_vl", tmp_path))
    config = LlmArgs(model=ckpt, device="cpu", kv_cache_max_tokens=4096).to_engine_config()
    assert config.checkpoint_dir == ckpt
    assert config.architecture == "Qwen2VLForConditionalGeneration"
    assert config.text_config is config.pretrained_config.text_config
    assert config.device == torch.device("cpu")
    assert config.dtype == torch.float32 and config.kv_cache_dtype == torch.float32
    assert config.attn_backend == "vanilla"
    assert config.max_batch_size is None and config.batch_size_cap == 8  # the CPU default
    assert config.kv_cache_max_tokens == 4096 and config.seed == 0
    assert config.max_seq_len == min(
        config.text_config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN_CAP
    )
    # No graphs off CUDA, whatever the graph config says.
    assert not config.use_cuda_graph and config.cuda_graph_batch_sizes is None
    assert config.piecewise_max_tokens == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_seq_len = 1  # type: ignore[misc]
    fp8 = LlmArgs(model=ckpt, device="cpu", kv_cache_dtype="fp8", dtype="bfloat16", seed=3)
    resolved = fp8.to_engine_config()
    assert resolved.dtype == torch.bfloat16 and resolved.kv_cache_dtype == torch.float8_e4m3fn
    assert resolved.seed == 3


@pytest.fixture
def as_if_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolution as on a CUDA machine (nothing in it touches the device)."""
    monkeypatch.setattr(LlmArgs, "resolve_device", lambda self: torch.device("cuda"))


@pytest.mark.parametrize(
    ("kwargs", "sizes", "piecewise"),
    [
        ({}, None, None),  # the defaults follow the batch sized at startup
        ({"max_batch_size": 20}, (1, 2, 4, 8, 16, 20), None),
        ({"cuda_graph_config": {"max_batch_size": 24}}, (1, 2, 4, 8, 16, 24), None),
        ({"cuda_graph_config": {"batch_sizes": [8, 3, 8], "enable_padding": False}}, (3, 8), None),
        ({"cuda_graph_config": {"piecewise_max_tokens": 0}}, None, 0),
        ({"cuda_graph_config": {"piecewise_max_tokens": 512}}, None, 512),
    ],
)
def test_cuda_graph_settings_resolve_where_knowable(
    as_if_cuda: None, tmp_path: Path, kwargs: dict, sizes: tuple | None, piecewise: int | None
) -> None:
    ckpt = str(write_tiny_checkpoint("qwen2_vl", tmp_path))
    config = LlmArgs(model=ckpt, **kwargs).to_engine_config()
    assert config.device.type == "cuda" and config.attn_backend == "triton"
    assert config.dtype == torch.float32  # the tiny checkpoint's own (CUDA keeps it)
    assert config.use_cuda_graph
    assert config.cuda_graph_batch_sizes == sizes
    padding = "enable_padding" not in kwargs.get("cuda_graph_config", {})
    assert config.cuda_graph_padding_enabled == padding
    assert config.piecewise_max_tokens == piecewise
    assert config.batch_size_cap == kwargs.get("max_batch_size", 512)


def test_graphs_off_resolve_to_off(as_if_cuda: None, tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen2_vl", tmp_path))
    for kwargs in ({"cuda_graph_config": None}, {"attn_backend": "vanilla"}):
        config = LlmArgs(model=ckpt, **kwargs).to_engine_config()
        assert not config.use_cuda_graph and config.piecewise_max_tokens == 0, kwargs


def test_flash_attn_off_cuda_keeps_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = str(write_tiny_checkpoint("qwen2_vl", tmp_path))
    args = LlmArgs(model=ckpt, attn_backend="flash_attn", tokens_per_block=256)
    monkeypatch.setattr(LlmArgs, "resolve_device", lambda self: torch.device("cpu"))
    with pytest.raises(ValueError, match="attn_backend 'flash_attn' runs on CUDA only, not on cpu"):
        args.to_engine_config()


def test_create_py_executor_takes_the_engine_config_only(tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen2", tmp_path))
    with pytest.raises(TypeError, match="takes an EngineConfig"):
        create_py_executor(LlmArgs(model=ckpt, device="cpu"), None)  # type: ignore[arg-type]
    assert isinstance(LlmArgs(model=ckpt, device="cpu").to_engine_config(), EngineConfig)
