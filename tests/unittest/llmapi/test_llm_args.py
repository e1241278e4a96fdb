"""LlmArgs: each bad field raises a ValueError naming it; unknown kwargs list the valid ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tensorrt_llm.llmapi.llm_args import DEFAULT_MAX_SEQ_LEN_CAP, FALLBACK_MAX_SEQ_LEN, LlmArgs


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    return str(tmp_path)


def test_defaults(model_dir: str) -> None:
    args = LlmArgs.from_kwargs(model=model_dir)
    assert args.max_batch_size is None and args.max_num_tokens == 4096  # None: sized at startup
    assert args.kv_cache_free_gpu_memory_fraction == 0.9 and args.tokens_per_block == 32
    assert args.dtype == "auto" and args.device == "auto" and args.enable_chunked_prefill
    assert args.max_seq_len is None and args.limit_mm_per_prompt is None


def test_pathlike_model_is_normalised(tmp_path: Path) -> None:
    assert LlmArgs(model=tmp_path).model == str(tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", "int8", "dtype must be one of"),
        ("device", "tpu", "device must be one of"),
        ("attn_backend", "magic", "attn_backend must be one of"),
        ("attn_backend", "flash_attn", "tokens_per_block to be a multiple of 256"),
        ("kv_cache_dtype", "int8", "kv_cache_dtype must be one of"),
        ("max_batch_size", 0, "max_batch_size must be >= 1"),
        ("max_batch_size", 2.5, "max_batch_size must be an int"),
        ("max_batch_size", True, "max_batch_size must be an int"),
        ("max_num_tokens", -1, "max_num_tokens must be >= 1"),
        ("max_seq_len", 0, "max_seq_len must be >= 1"),
        ("kv_cache_max_tokens", 0, "kv_cache_max_tokens must be >= 1"),
        ("tokens_per_block", 0, "tokens_per_block must be >= 1"),
        ("seed", -3, "seed must be >= 0"),
        ("recurrent_state_snapshot_mib", 0, "recurrent_state_snapshot_mib must be >= 1"),
        ("recurrent_state_snapshot_mib", 1.5, "recurrent_state_snapshot_mib must be an int"),
        ("kv_cache_free_gpu_memory_fraction", 0.0, r"kv_cache_free_gpu_memory_fraction"),
        ("kv_cache_free_gpu_memory_fraction", 1.5, r"in \(0, 1\]"),
        ("kv_cache_free_gpu_memory_fraction", "0.5", r"in \(0, 1\]"),
        ("enable_chunked_prefill", "yes", "enable_chunked_prefill must be a bool"),
        ("cuda_graph_config", {"batch_sizes": []}, "batch_sizes must be a non-empty list"),
        ("cuda_graph_config", {"batch_sizes": [0]}, "batch_sizes entry must be >= 1"),
        ("cuda_graph_config", {"batch_sizes": [16]}, "more than max_batch_size 8"),
        ("cuda_graph_config", {"max_batch_size": 9}, "more than max_batch_size 8"),
        ("cuda_graph_config", {"enable_padding": 1}, "enable_padding must be a bool"),
        ("cuda_graph_config", {"pad": True}, r"unknown cuda_graph_config field\(s\) \['pad'\]"),
        ("cuda_graph_config", [4], "must be a CudaGraphConfig, a dict or None"),
        ("limit_mm_per_prompt", [1], "limit_mm_per_prompt must be a dict"),
        ("limit_mm_per_prompt", {"audio": 1}, "limit_mm_per_prompt key must be one of"),
        ("limit_mm_per_prompt", {"image": -1}, r"limit_mm_per_prompt\['image'\] must be >= 0"),
        ("mm_processor_kwargs", "x", "mm_processor_kwargs must be a dict"),
        ("mm_processor_kwargs", {"fps": -1}, "mm_processor_kwargs.*fps"),
    ],
)
def test_bad_field_raises(model_dir: str, field: str, value: Any, match: str) -> None:
    # An explicit max_batch_size, so the graph sizes are checked against it up front.
    extra = {} if field == "max_batch_size" else {"max_batch_size": 8}
    with pytest.raises(ValueError, match=match):
        LlmArgs.from_kwargs(model=model_dir, **{field: value, **extra})


def test_unknown_kwargs_list_valid_ones(model_dir: str) -> None:
    with pytest.raises(ValueError, match=r"unknown LLM argument\(s\) \['max_batch'\]") as info:
        LlmArgs.from_kwargs(model=model_dir, max_batch=4)
    assert "max_batch_size" in str(info.value) and "kv_cache_free_gpu_memory_fraction" in str(
        info.value
    )


def test_model_must_be_a_local_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model is required"):
        LlmArgs.from_kwargs(dtype="auto")
    with pytest.raises(ValueError, match="not a directory"):
        LlmArgs.from_kwargs(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="non-empty path"):
        LlmArgs.from_kwargs(model="")
    with pytest.raises(ValueError, match="tokenizer must be a local folder"):
        LlmArgs.from_kwargs(model=str(tmp_path), tokenizer=str(tmp_path / "nope"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_device_is_rejected(model_dir: str) -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        LlmArgs.from_kwargs(model=model_dir, device="cuda")


def test_frozen(model_dir: str) -> None:
    args = LlmArgs.from_kwargs(model=model_dir)
    with pytest.raises(AttributeError):
        args.max_batch_size = 3  # type: ignore[misc]


def test_resolve_max_seq_len(model_dir: str) -> None:
    args = LlmArgs.from_kwargs(model=model_dir)
    assert args.resolve_max_seq_len(2048) == 2048
    assert args.resolve_max_seq_len(262144) == DEFAULT_MAX_SEQ_LEN_CAP
    assert args.resolve_max_seq_len(None) == FALLBACK_MAX_SEQ_LEN
    assert LlmArgs.from_kwargs(model=model_dir, max_seq_len=100000).resolve_max_seq_len(2048) == (
        100000
    )


def test_resolve_device_and_dtype(model_dir: str) -> None:
    cpu = LlmArgs.from_kwargs(model=model_dir, device="cpu")
    assert cpu.resolve_device() == torch.device("cpu")
    assert cpu.resolve_dtype(torch.bfloat16) == torch.float32  # CPU half math is slow
    half = LlmArgs.from_kwargs(model=model_dir, device="cpu", dtype="float16")
    assert half.resolve_dtype("bfloat16") == torch.float16
    auto = LlmArgs.from_kwargs(model=model_dir)
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert auto.resolve_device().type == want
    if torch.cuda.is_available():
        assert auto.resolve_dtype("bfloat16") == torch.bfloat16
        assert auto.resolve_dtype(None) == torch.bfloat16


def test_llm_rejects_bad_kwargs_before_loading(model_dir: str) -> None:
    from tensorrt_llm import LLM

    with pytest.raises(ValueError, match="valid arguments"):
        LLM(model_dir, kv_cache_fraction=0.5)
    with pytest.raises(ValueError, match="max_num_tokens must be >= 1"):
        LLM(model_dir, max_num_tokens=0)


def test_triton_backend_off_cuda_is_a_clear_error(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not Triton's "0 active drivers" from the first kernel launch of the capacity probe.
    args = LlmArgs(model=model_dir, attn_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attn_backend 'triton' runs on CUDA only, not on cpu"):
        args.resolve_attn_backend(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the tests' interpreter runs the kernels
    assert args.resolve_attn_backend(torch.device("cpu")) == "triton"


def test_knobs_the_cpu_does_not_use_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    from tensorrt_llm.llmapi import CudaGraphConfig
    from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

    ckpt = str(get_or_build_demo_checkpoint())
    with caplog.at_level("WARNING", logger="tensorrt_llm.llmapi.args_checks"):
        LlmArgs(model=ckpt, device="cpu").to_engine_config()
    assert not caplog.records  # the defaults say nothing
    given = LlmArgs(
        model=ckpt,
        device="cpu",
        kv_cache_config={"free_gpu_memory_fraction": 0.5},
        cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2]),
    )
    with caplog.at_level("WARNING", logger="tensorrt_llm.llmapi.args_checks"):
        given.to_engine_config()
    assert "kv_cache_free_gpu_memory_fraction=0.5 has no effect on cpu" in caplog.text
    assert "cap it with kv_cache_max_tokens" in caplog.text
    assert "cuda_graph_config is not used" in caplog.text
