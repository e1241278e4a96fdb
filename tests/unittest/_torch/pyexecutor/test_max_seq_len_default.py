"""max_seq_len defaults to the checkpoint's context length, capped by the sized KV cache.

Resolution (LlmArgs -> EngineConfig), the cap and its log line, the CUDA arithmetic with the
memory queries faked, and end to end on the CPU: the front end learns the engine's final
value (both executor modes) and a request over it still fails before submission. Block
tables are filled per step only as wide as the step needs, which must not change outputs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor import kv_cache_creator
from tensorrt_llm._torch.pyexecutor.capacity import cap_max_seq_len
from tensorrt_llm._torch.pyexecutor.engine_config import (
    MAX_SEQ_LEN_CONFIG,
    MAX_SEQ_LEN_CPU_CAP,
    MAX_SEQ_LEN_USER,
)
from tensorrt_llm._torch.pyexecutor.kv_cache_creator import (
    KVCacheSpec,
    choose_num_blocks,
    kv_bytes_per_token,
    kv_tokens_upper_bound,
)
from tensorrt_llm.llmapi import PromptTooLongError
from tensorrt_llm.llmapi.llm_args import DEFAULT_MAX_SEQ_LEN_CAP, LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

GiB = 2**30
SPEC = KVCacheSpec(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
LONG_CONTEXT = 262144
CREATOR_LOGGER = "tensorrt_llm._torch.pyexecutor.py_executor_creator"


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny text checkpoint that declares Qwen3.6's 262144-token context."""
    out = tmp_path_factory.mktemp("long_context")
    return write_tiny_checkpoint("qwen2", out, max_position_embeddings=LONG_CONTEXT)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    state = {"free": 100 * GiB}
    monkeypatch.setattr(kv_cache_creator.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(
        kv_cache_creator.torch.cuda, "mem_get_info", lambda device=None: (state["free"], 141 * GiB)
    )
    return state


# ---- resolution -------------------------------------------------------------------------------
def test_cuda_takes_the_full_context_length_the_cpu_caps_it(
    long_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = LlmArgs(model=str(long_ckpt), device="cpu").to_engine_config()
    assert (cpu.max_seq_len, cpu.max_seq_len_source) == (
        DEFAULT_MAX_SEQ_LEN_CAP,
        MAX_SEQ_LEN_CPU_CAP,
    )
    user = LlmArgs(model=str(long_ckpt), device="cpu", max_seq_len=300).to_engine_config()
    assert (user.max_seq_len, user.max_seq_len_source) == (300, MAX_SEQ_LEN_USER)
    monkeypatch.setattr(LlmArgs, "resolve_device", lambda self: torch.device("cuda"))
    cuda = LlmArgs(model=str(long_ckpt)).to_engine_config()
    assert (cuda.max_seq_len, cuda.max_seq_len_source) == (LONG_CONTEXT, MAX_SEQ_LEN_CONFIG)


def test_the_cap_names_the_bound_and_the_knobs() -> None:
    kv = cap_max_seq_len(LONG_CONTEXT, MAX_SEQ_LEN_CONFIG, 100_000, 0.9, LONG_CONTEXT)
    assert (kv.max_seq_len, kv.bound) == (100_000, "kv cache")
    text = kv.describe()
    assert "kv_cache_free_gpu_memory_fraction (now 0.9)" in text and "max_seq_len=" in text
    roomy = cap_max_seq_len(LONG_CONTEXT, MAX_SEQ_LEN_CONFIG, 500_000, 0.9, LONG_CONTEXT)
    assert (roomy.max_seq_len, roomy.bound) == (LONG_CONTEXT, "max_position_embeddings")
    assert "max_seq_len=" in roomy.describe()
    given = cap_max_seq_len(4096, MAX_SEQ_LEN_USER, 1024, 0.9, LONG_CONTEXT)
    assert (given.max_seq_len, given.bound) == (4096, "max_seq_len")  # the user's is never cut


# ---- the CUDA arithmetic ------------------------------------------------------------------------
def test_a_default_length_fits_any_cache_a_given_one_must(fake_gpu: dict[str, int]) -> None:
    cuda = torch.device("cuda")
    fake_gpu["free"] = 2 * GiB  # ~14k bf16 tokens of this spec, far below 262144
    wanted = LONG_CONTEXT // 32
    with pytest.raises(RuntimeError, match="one max_seq_len sequence"):
        choose_num_blocks(SPEC, cuda, 32, 8, wanted, 0.9, None)
    blocks = choose_num_blocks(SPEC, cuda, 32, 8, wanted, 0.9, None, seq_len_capped_after=True)
    assert blocks == int(2 * GiB * 0.9) // (kv_bytes_per_token(SPEC) * 32) < wanted


def test_block_tables_are_bounded_by_what_memory_could_hold(fake_gpu: dict[str, int]) -> None:
    cuda = torch.device("cuda")
    fake_gpu["free"] = 2 * GiB
    bound = kv_tokens_upper_bound(SPEC, cuda, 0.9, None)
    assert bound == int(2 * GiB * 0.9) // kv_bytes_per_token(SPEC)
    assert kv_tokens_upper_bound(SPEC, cuda, 0.9, 5000) == 5000
    assert kv_tokens_upper_bound(SPEC, torch.device("cpu"), 0.9, None) is None
    # What the engine's tables cost at the bound: [512 slots, blocks] int32 on the device.
    assert 512 * -(-bound // 32) * 4 < 2**20


# ---- end to end on the CPU ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["inproc", "process"])
def test_the_front_end_learns_the_kv_capped_length(
    long_ckpt: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    kwargs: dict[str, Any] = dict(device="cpu", kv_cache_max_tokens=600, tokens_per_block=16)
    with caplog.at_level(logging.INFO, logger=CREATOR_LOGGER):
        with LLM(str(long_ckpt), executor_mode=mode, max_num_tokens=128, **kwargs) as llm:
            assert llm.max_seq_len == 608  # 38 blocks of 16: what the cache holds
            out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0.0))
            assert out.outputs[0].finish_reason == "length"
            with pytest.raises(PromptTooLongError, match="max_seq_len=608"):
                llm.generate("hello", SamplingParams(max_tokens=700))
    if mode == "inproc":  # the process-mode line is logged by the engine process
        assert "max_seq_len 608 (bound: kv cache)" in caplog.text
        assert "kv_cache_free_gpu_memory_fraction" in caplog.text


def test_narrow_block_tables_keep_outputs(tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen2", tmp_path))
    prompts = ["a b", "one two three four five six seven eight nine ten " * 3, "x"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kwargs: dict[str, Any] = dict(
        device="cpu", executor_mode="inproc", kv_cache_max_tokens=2048, tokens_per_block=4
    )
    with LLM(ckpt, max_seq_len=256, **kwargs) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(ckpt, max_seq_len=LONG_CONTEXT, **kwargs) as llm:
        builder = llm._executor.model_engine.batch_builder
        widths: list[int] = []
        copy = builder._h2d_columns

        def spy(dst: torch.Tensor, host: np.ndarray) -> torch.Tensor:
            widths.append(host.shape[1])
            return copy(dst, host)

        builder._h2d_columns = spy
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        table_width = llm._executor.model_engine.buffers.block_tables.shape[1]
    assert got == want
    assert table_width == LONG_CONTEXT // 4 and max(widths) <= 64  # not 65536 columns a step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_is_the_context_length_or_the_kv_cache(long_ckpt: Path) -> None:
    prompts = ["a b", "one two three four five six seven eight nine ten " * 3, "x"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kwargs: dict[str, Any] = dict(executor_mode="inproc", max_batch_size=8, max_num_tokens=512)
    with LLM(str(long_ckpt), max_seq_len=512, **kwargs) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # The tiny model's KV cache holds far more than 262144 tokens: the context length wins,
    # and decode graphs replay with tables filled only as wide as each step needs.
    with LLM(str(long_ckpt), **kwargs) as llm:
        assert llm.max_seq_len == LONG_CONTEXT
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    with LLM(str(long_ckpt), kv_cache_max_tokens=100_000, **kwargs) as llm:
        assert llm.max_seq_len == 100_000  # 3125 blocks of 32
        assert llm._executor.model_engine.max_blocks_per_seq == 3125  # tables bounded too
        with pytest.raises(PromptTooLongError, match="max_seq_len=100000"):
            llm.generate("hello", SamplingParams(max_tokens=100_000))
