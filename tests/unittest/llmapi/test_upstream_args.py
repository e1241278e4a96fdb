"""TensorRT-LLM's spellings of LLM arguments: KvCacheConfig, backend, parallel sizes."""

from __future__ import annotations

import dataclasses

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import CudaGraphConfig, KvCacheConfig, LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint


@pytest.fixture(scope="module")
def ckpt() -> str:
    return str(get_or_build_demo_checkpoint())


def test_kv_cache_config_maps_onto_the_flat_fields(ckpt: str) -> None:
    kv = KvCacheConfig(free_gpu_memory_fraction=0.5, max_tokens=4096, dtype="fp8")
    args = LlmArgs(model=ckpt, kv_cache_config=kv, backend="pytorch", tensor_parallel_size=1)
    assert args.kv_cache_free_gpu_memory_fraction == 0.5
    assert args.kv_cache_max_tokens == 4096 and args.kv_cache_dtype == "fp8"
    as_dict = LlmArgs(model=ckpt, kv_cache_config={"free_gpu_memory_fraction": 0.7})
    assert as_dict.kv_cache_free_gpu_memory_fraction == 0.7
    assert isinstance(as_dict.kv_cache_config, KvCacheConfig)
    assert LlmArgs(model=ckpt, kv_cache_config=KvCacheConfig()).kv_cache_dtype == "auto"


def test_kv_cache_config_of_upstream_fields_is_a_clear_error() -> None:
    # Code ported from TensorRT-LLM passes its other knobs to the constructor itself.
    with pytest.raises(ValueError, match=r"\['enable_partial_reuse'\]: not supported") as err:
        KvCacheConfig(free_gpu_memory_fraction=0.8, enable_partial_reuse=False)
    assert "'max_tokens'" in str(err.value)  # says what is supported
    assert KvCacheConfig(max_tokens=64) == KvCacheConfig(max_tokens=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        KvCacheConfig().max_tokens = 3  # type: ignore[misc]


def test_enable_block_reuse_maps_and_defaults_on(ckpt: str) -> None:
    off = LlmArgs(model=ckpt, kv_cache_config={"enable_block_reuse": False})
    assert off.enable_block_reuse is False
    assert LlmArgs(model=ckpt, kv_cache_config=KvCacheConfig()).enable_block_reuse is None
    # The demo checkpoint is full attention: None resolves to on.
    assert LlmArgs(model=ckpt).to_engine_config().enable_block_reuse is True
    assert off.to_engine_config().enable_block_reuse is False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_cache_config": {"enable_block_reuse": "yes"}}, "enable_block_reuse must be"),
        ({"kv_cache_config": {"host_cache_size": 1}}, r"unknown kv_cache_config field\(s\)"),
        ({"kv_cache_config": 3}, "must be a KvCacheConfig"),
        (
            {"kv_cache_config": KvCacheConfig(max_tokens=64), "kv_cache_max_tokens": 128},
            "disagree",
        ),
        ({"kv_cache_config": KvCacheConfig(free_gpu_memory_fraction=2.0)}, "fraction"),
        ({"backend": "tensorrt"}, "backend must be one of"),
        ({"pipeline_parallel_size": 2}, "pipeline parallelism is not supported"),
        ({"mm_encoder_tp_mode": "weights"}, "only 'data'"),
        ({"tensor_parallel_size": 2, "executor_mode": "inproc"}, "needs executor_mode='process'"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be an int >= 1"),
    ],
)
def test_unsupported_values_are_clear_errors(ckpt: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LlmArgs(model=ckpt, **kwargs)


def test_an_upstream_script_runs(ckpt: str) -> None:
    with LLM(
        model=ckpt,
        backend="pytorch",
        tensor_parallel_size=1,
        kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.8, enable_block_reuse=False),
        cuda_graph_config=CudaGraphConfig(),
        device="cpu",
    ) as llm:
        out = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out.outputs[0].token_ids) == 2
