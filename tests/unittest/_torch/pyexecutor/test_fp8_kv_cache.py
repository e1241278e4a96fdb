"""`kv_cache_dtype="fp8"`: the engine allocates an e4m3 KV cache and still generates (CPU
through the vanilla backend; GPU through Triton + graphs)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

PROMPTS = ["hello there", "a longer prompt about the weather in the mountains today"]


def _run(device: str, kv_cache_dtype: str) -> tuple[list[list[int]], torch.dtype]:
    ckpt = str(get_or_build_demo_checkpoint())
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(
        model=ckpt,
        device=device,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_max_tokens=4096,
        executor_mode="inproc",  # the test reads the engine's KV cache
    ) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return tokens, llm._executor.kv_cache_manager.get_buffers(0).dtype


def _agreement(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_fp8_kv_cache_on_cpu_generates() -> None:
    fp8_tokens, fp8_dtype = _run("cpu", "fp8")
    full_tokens, full_dtype = _run("cpu", "auto")
    assert fp8_dtype == torch.float8_e4m3fn and full_dtype == torch.float32
    assert all(len(t) == 6 for t in fp8_tokens)
    # Greedy tokens of the tiny random model mostly survive e4m3 K/V; the first token of each
    # request comes from a prefill that reads the quantised cache as well.
    assert _agreement(fp8_tokens, full_tokens) >= 6


def test_bad_kv_cache_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=str(get_or_build_demo_checkpoint()), kv_cache_dtype="int4")


@pytest.mark.gpu
def test_fp8_kv_cache_on_gpu_with_graphs_generates_like_bf16() -> None:
    fp8_tokens, fp8_dtype = _run("cuda", "fp8")
    full_tokens, full_dtype = _run("cuda", "auto")
    # The demo checkpoint is stored in float32, which "auto" keeps on the GPU too.
    assert fp8_dtype == torch.float8_e4m3fn and full_dtype == torch.float32
    assert _agreement(fp8_tokens, full_tokens) >= 6
