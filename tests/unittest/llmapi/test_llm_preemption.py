"""Preemption by recompute end to end: a KV cache too small for every request at once.

Each request must produce exactly what it produces with a cache that holds them all, greedy and
seeded (with a penalty and logprobs, whose per-request state must survive), on a dense VL model
with an image in the prompt (so the recomputed tokens' mRoPE positions matter) and on the hybrid
Qwen3.5 stack (recurrent state rebuilt from zero); both executors; streams neither repeat nor
skip; a request larger than the whole cache fails alone while the others finish.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from PIL import Image

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import PromptTooLongError
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

MAX_TOKENS = 20
TPB = 4
MAX_SEQ_LEN = 128
# Holds about two requests (prompt ~20-40 tokens + 20 generated): the others must wait or be
# preempted; the large cache holds all of them.
SMALL_KV_TOKENS = 96
LARGE_KV_TOKENS = 4096
TEXTS = ["the quick brown fox", "a b c d e f g h i j k", "once upon a time", "hello"]


@pytest.fixture(scope="module")
def image() -> Image.Image:
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (56, 84, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _llm(family: str, kv_tokens: int, overlap: bool = True) -> LLM:
    return LLM(
        str(get_or_build_demo_checkpoint(family)),
        device="cpu",
        executor_mode="inproc",
        max_batch_size=4,
        max_num_tokens=64,
        max_seq_len=MAX_SEQ_LEN,
        kv_cache_max_tokens=kv_tokens,
        tokens_per_block=TPB,
        disable_overlap_scheduler=not overlap,
    )


def _inputs(llm: LLM, image: Image.Image, with_image: bool) -> list[Any]:
    inputs: list[Any] = list(TEXTS)
    if with_image:
        prompt = llm.input_processor.default_multimodal_prompt("Describe it.", num_images=1)
        inputs[0] = {"prompt": prompt, "multi_modal_data": {"image": [image]}}
        inputs[2] = {"prompt": prompt, "multi_modal_data": {"image": [image]}}
    return inputs


def _params(seeded: bool) -> list[SamplingParams]:
    if not seeded:
        return [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * 4
    return [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.9,
            seed=10 + i,
            ignore_eos=True,
            frequency_penalty=0.5,
            logprobs=1,
        )
        for i in range(4)
    ]


def _run(llm: LLM, inputs: list[Any], params: list[SamplingParams]) -> list[Any]:
    """All requests submitted together; (token ids, logprob floats) per request."""
    outs = llm.generate(inputs, params)
    result = []
    for out in outs:
        completion = out.outputs[0]
        logprobs = [next(iter(entry.values())).logprob for entry in completion.logprobs or []]
        result.append((list(completion.token_ids), logprobs))
    return result


CASES = [("qwen2_vl", True), ("qwen3_5", True), ("qwen3_5", False)]


@pytest.mark.parametrize(("family", "with_image"), CASES)
def test_small_cache_matches_large_cache(family: str, with_image: bool, image: Image.Image) -> None:
    with _llm(family, LARGE_KV_TOKENS) as big:
        inputs = _inputs(big, image, with_image)
        want = {seeded: _run(big, inputs, _params(seeded)) for seeded in (False, True)}
        assert big.get_stats().num_preemptions == 0
    for overlap in (True, False):
        with _llm(family, SMALL_KV_TOKENS, overlap) as small:
            for seeded in (False, True):
                got = _run(small, inputs, _params(seeded))
                case = (family, overlap, seeded)
                assert [ids for ids, _ in got] == [ids for ids, _ in want[seeded]], case
                # Recomputed KV / recurrent state differs from the incremental one by rounding.
                for (_, lp), (_, ref) in zip(got, want[seeded], strict=True):
                    assert lp == pytest.approx(ref, abs=1e-3), case
                assert all(len(ids) == MAX_TOKENS for ids, _ in got)
            stats = small.get_stats()
            assert stats.num_preemptions > 0, "the small cache must force preemptions"
            assert stats.num_free_kv_blocks == stats.num_total_kv_blocks


def test_streams_neither_repeat_nor_skip(image: Image.Image) -> None:
    params = _params(False)
    with _llm("qwen2_vl", LARGE_KV_TOKENS) as big:
        inputs = _inputs(big, image, True)
        want = [ids for ids, _ in _run(big, inputs, params)]
    with _llm("qwen2_vl", SMALL_KV_TOKENS) as small:

        async def stream_all() -> list[list[int]]:
            async def one(x: Any, p: SamplingParams) -> list[int]:
                ids: list[int] = []
                async for part in small.generate_async(x, p, streaming=True):
                    ids += part.outputs[0].token_ids_diff
                return ids

            return await asyncio.gather(*(one(x, p) for x, p in zip(inputs, params, strict=True)))

        assert asyncio.run(stream_all()) == want
        assert small.get_stats().num_preemptions > 0


def test_request_larger_than_the_cache_fails_alone() -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with _llm("qwen2", SMALL_KV_TOKENS) as small:
        handles = [small.generate_async(t, params) for t in TEXTS]
        too_big = SamplingParams(max_tokens=MAX_SEQ_LEN - 8, temperature=0.0, ignore_eos=True)
        with pytest.raises(PromptTooLongError, match="KV blocks.*kv_cache_config.max_tokens"):
            small.generate("hello", too_big)
        outs = [h.result() for h in handles]
        assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


@pytest.mark.parametrize("overlap", [True, False])
def test_guided_requests_survive_preemption(overlap: bool) -> None:
    """The grammar matcher is kept (it has accepted exactly the outputs): after the recompute
    the masks continue where they were, so the text equals the large cache's and still matches."""
    pytest.importorskip("xgrammar")
    from tensorrt_llm import GuidedDecodingParams

    guided = GuidedDecodingParams(regex="[a-z]{20}")
    params = SamplingParams(max_tokens=24, temperature=0.0, guided_decoding=guided)
    kwargs: dict[str, Any] = dict(
        device="cpu", executor_mode="inproc", max_batch_size=4, max_seq_len=64, tokens_per_block=4
    )
    ckpt = str(get_or_build_demo_checkpoint("qwen3"))
    with LLM(ckpt, kv_cache_max_tokens=LARGE_KV_TOKENS, **kwargs) as big:
        want = [o.outputs[0].text for o in big.generate(TEXTS, params)]
    with LLM(
        ckpt, kv_cache_max_tokens=64, disable_overlap_scheduler=not overlap, **kwargs
    ) as small:
        got = [o.outputs[0].text for o in small.generate(TEXTS, params)]
        assert small.get_stats().num_preemptions > 0
    assert got == want
    assert all(len(text) == 20 and text.isalpha() for text in got)


def test_priority_picks_the_victims() -> None:
    """Lower priority values run first: the most important request is never preempted, and the
    first victim is the least important one running."""
    prios = [1, 0, 0, -1]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, priority=p)
        for p in prios
    ]
    with _llm("qwen2", SMALL_KV_TOKENS) as small:
        scheduler = small._executor.scheduler
        victims: list[int] = []
        preempt = scheduler._preempt

        def spy(req: Any, scheduled: Any) -> None:
            victims.append(req.priority)
            preempt(req, scheduled)

        scheduler._preempt = spy
        outs = small.generate(TEXTS, params)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    assert victims and -1 not in victims and victims[0] == 1


def test_process_mode_small_cache_matches() -> None:
    """The engine in its own process: same outputs, and the preemption count reaches the stats."""
    params = _params(False)
    ckpt = str(get_or_build_demo_checkpoint("qwen2"))
    kwargs: dict[str, Any] = dict(
        device="cpu", max_batch_size=4, max_seq_len=MAX_SEQ_LEN, tokens_per_block=TPB
    )
    with LLM(ckpt, executor_mode="inproc", kv_cache_max_tokens=LARGE_KV_TOKENS, **kwargs) as big:
        want = _run(big, TEXTS, params)
    with LLM(ckpt, executor_mode="process", kv_cache_max_tokens=SMALL_KV_TOKENS, **kwargs) as small:
        assert _run(small, TEXTS, params) == want
        assert small.get_stats().num_preemptions > 0
