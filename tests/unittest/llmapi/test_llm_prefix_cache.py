"""Prefix caching (KV block reuse) end to end on the tiny demo checkpoints, CPU.

A hit must change nothing but the work done: every request gives the tokens (greedy and seeded)
it gives with reuse off, while `num_cached_tokens` says exactly how many prompt tokens came from
the cache (whole blocks, never the last prompt token, never past an image that differs). Under
pressure cached blocks are evicted, alone or together with chunked prefill and preemption; both
executors; the engine in its own process once (hybrid models: test_llm_prefix_cache_hybrid.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

TPB = 4
MAX_TOKENS = 12
MAX_SEQ_LEN = 128
LARGE_KV_TOKENS = 4096
TEXT = "the quick brown fox jumps over the lazy dog and keeps on running far away"
OTHER_TEXTS = [f"story number {i}: once upon a time there was a tiny model" for i in range(6)]


def _image(seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (56, 84, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _llm(
    reuse: bool | None,
    family: str = "qwen2_vl",
    kv_tokens: int = LARGE_KV_TOKENS,
    overlap: bool = True,
    **kwargs: Any,
) -> LLM:
    kv: dict[str, Any] = {"max_tokens": kv_tokens}
    if reuse is not None:
        kv["enable_block_reuse"] = reuse
    return LLM(
        str(get_or_build_demo_checkpoint(family)),
        device="cpu",
        executor_mode=kwargs.pop("executor_mode", "inproc"),
        max_batch_size=4,
        max_num_tokens=kwargs.pop("max_num_tokens", 64),
        max_seq_len=MAX_SEQ_LEN,
        tokens_per_block=TPB,
        disable_overlap_scheduler=not overlap,
        kv_cache_config=kv,
        **kwargs,
    )


def _params(seeded: bool, seed: int = 7) -> SamplingParams:
    if seeded:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=seed, ignore_eos=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _ids(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def _full_hit(prompt_len: int) -> int:
    """What a repeat of a cached prompt hits: every whole block short of the last token."""
    return (prompt_len - 1) // TPB * TPB


def _image_prompt(llm: LLM, image: Image.Image) -> dict[str, Any]:
    prompt = llm.input_processor.default_multimodal_prompt("Describe it.", num_images=1)
    return {"prompt": prompt, "multi_modal_data": {"image": [image]}}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Outputs with reuse off (one engine, large cache)."""
    with _llm(False) as off:
        want = {f"text-{s}": _ids(off.generate(TEXT, _params(s))) for s in (False, True)}
        for seed in (0, 1):
            image = _image_prompt(off, _image(seed))
            want[f"image-{seed}"] = _ids(off.generate(image, _params(False)))
        for i, text in enumerate(OTHER_TEXTS):
            want[f"other-{i}"] = _ids(off.generate(text, _params(False)))
        assert off.generate(TEXT, _params(False)).num_cached_tokens == 0
        assert not off._executor.kv_cache_manager.enable_block_reuse
    return want


@pytest.mark.parametrize("overlap", [True, False])
def test_repeated_prompt_hits_and_matches_reuse_off(overlap: bool, reference: dict) -> None:
    with _llm(None, overlap=overlap) as llm:  # None: the default, on for this model
        assert llm._executor.kv_cache_manager.enable_block_reuse
        for seeded in (False, True):
            first = llm.generate(TEXT, _params(seeded))
            again = llm.generate(TEXT, _params(seeded))
            assert _ids(first) == _ids(again) == reference[f"text-{seeded}"], seeded
            assert again.num_cached_tokens == _full_hit(len(again.prompt_token_ids))
            # The first run of the greedy pass misses; the seeded pass finds it cached.
            assert first.num_cached_tokens == (0 if not seeded else again.num_cached_tokens)
        stats = llm.get_stats()
        assert stats.prefix_cache_hits == 3 * again.num_cached_tokens
        assert stats.prefix_cache_queries == 4 * len(again.prompt_token_ids)


def test_cache_salt_separates_the_namespaces(reference: dict) -> None:
    with _llm(True) as llm:
        llm.generate(TEXT, _params(False))
        salted = {"prompt": TEXT, "cache_salt": "tenant-a"}
        first = llm.generate(salted, _params(False))
        again = llm.generate(salted, _params(False))
        other = llm.generate({"prompt": TEXT, "cache_salt": "tenant-b"}, _params(False))
        assert first.num_cached_tokens == other.num_cached_tokens == 0
        assert again.num_cached_tokens == _full_hit(len(again.prompt_token_ids))
        assert _ids(first) == _ids(again) == _ids(other) == reference["text-False"]
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate({"prompt": TEXT, "cache_salt": ""}, _params(False))


def test_another_image_hits_only_the_blocks_before_it(reference: dict) -> None:
    with _llm(True) as llm:
        first = llm.generate(_image_prompt(llm, _image(0)), _params(False))
        same = llm.generate(_image_prompt(llm, _image(0)), _params(False))
        other = llm.generate(_image_prompt(llm, _image(1)), _params(False))
        assert first.num_cached_tokens == 0
        assert same.num_cached_tokens == _full_hit(len(same.prompt_token_ids))
        image_id = llm.input_processor.image_token_id
        image_start = same.prompt_token_ids.index(image_id)
        # The text before the image is shared; the block holding its first pad token is not.
        assert other.num_cached_tokens == image_start // TPB * TPB < same.num_cached_tokens
        assert _ids(first) == _ids(same) == reference["image-0"]
        assert _ids(other) == reference["image-1"]


def test_eviction_under_pressure_keeps_outputs_exact(reference: dict) -> None:
    # ~24 blocks: a few requests' worth, so the distinct prompts evict the first one's blocks.
    with _llm(True, kv_tokens=96) as llm:
        kv = llm._executor.kv_cache_manager
        first = llm.generate(OTHER_TEXTS[0], _params(False))
        for i, text in enumerate(OTHER_TEXTS[1:], start=1):
            assert _ids(llm.generate(text, _params(False))) == reference[f"other-{i}"]
        assert kv.prefix_cache_stats.evictions > 0
        again = llm.generate(OTHER_TEXTS[0], _params(False))
        assert _ids(first) == _ids(again) == reference["other-0"]
        assert again.num_cached_tokens < _full_hit(len(again.prompt_token_ids))
        kv.pool.check_invariants()


@pytest.mark.parametrize("overlap", [True, False])
def test_shared_prefix_with_chunked_prefill_and_preemption(overlap: bool) -> None:
    """Many requests on one long shared prefix in a pool too small for them all, with prefill
    chunks of 8 tokens: hits, chunking and preemption together give reuse-off outputs."""
    prefix = TEXT + " " + TEXT
    inputs = [f"{prefix} variant {i}" for i in range(6)]
    params = [_params(True, seed=i) for i in range(6)]
    with _llm(False, max_num_tokens=8) as off:
        want = [_ids(o) for o in off.generate(inputs, params)]
    with _llm(True, kv_tokens=120, overlap=overlap, max_num_tokens=8) as llm:
        llm.generate(inputs[0], params[0])  # the prefix is cached before the burst
        outs = llm.generate(inputs, params)
        assert [_ids(o) for o in outs] == want
        stats = llm.get_stats()
        assert stats.num_preemptions > 0, "the small pool must force preemptions"
        assert outs[0].num_cached_tokens == _full_hit(len(outs[0].prompt_token_ids))
        assert all(o.num_cached_tokens > 0 for o in outs)
        assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
        llm._executor.kv_cache_manager.pool.check_invariants()


def test_process_mode_reports_cached_tokens(reference: dict) -> None:
    with _llm(True, executor_mode="process") as llm:
        first = llm.generate(TEXT, _params(False))
        again = llm.generate(TEXT, _params(False))
        assert _ids(first) == _ids(again) == reference["text-False"]
        assert first.num_cached_tokens == 0
        assert again.num_cached_tokens == _full_hit(len(again.prompt_token_ids))
        assert llm.get_stats().prefix_cache_hits == again.num_cached_tokens
        # Media hashes cross the process boundary with the request.
        image = _image_prompt(llm, _image(0))
        llm.generate(image, _params(False))
        repeat = llm.generate(image, _params(False))
        assert repeat.num_cached_tokens == _full_hit(len(repeat.prompt_token_ids))
        assert _ids(repeat) == reference["image-0"]
        # The salt crosses it too.
        salted = {"prompt": TEXT, "cache_salt": "s"}
        assert llm.generate(salted, _params(False)).num_cached_tokens == 0
        assert llm.generate(salted, _params(False)).num_cached_tokens == again.num_cached_tokens


@pytest.mark.parametrize("overlap", [True, False])
def test_next_turn_hits_the_generated_blocks(overlap: bool) -> None:
    """Prompt + answer as the next prompt: the answer's full blocks were registered as they
    filled (with the overlap executor a step late), so the hit reaches into them."""
    with _llm(True, overlap=overlap) as llm:
        # Several answer lengths, so the answer's end falls on every offset in a block.
        for max_tokens in range(9, 9 + TPB):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            first = llm.generate(f"{max_tokens} {TEXT}", params)
            history = list(first.prompt_token_ids) + _ids(first)
            follow = llm.generate({"prompt_token_ids": history + [5, 6, 7]}, params)
            # The last answer token's KV is never written (nothing ran after it).
            assert follow.num_cached_tokens == (len(history) - 1) // TPB * TPB, max_tokens
            assert follow.num_cached_tokens > _full_hit(len(first.prompt_token_ids))


def _count_tower_patches(llm: LLM) -> list[int]:
    """Patches the vision tower encodes from now on (a one-item list, updated in place)."""
    model = llm._executor.model_engine.model
    seen = [0]
    real = model._run_tower

    def counting(pixels: torch.Tensor, grid: torch.Tensor) -> Any:
        seen[0] += pixels.shape[0]
        return real(pixels, grid)

    model._run_tower = counting
    return seen


@pytest.mark.parametrize("embedding_cache_mib", [None, 0])
def test_tower_skipped_for_cached_images(embedding_cache_mib: int | None, reference: dict) -> None:
    """A repeat whose hit covers the image skips the tower; once the image's KV is evicted the
    vision-embedding cache still spares the tower (unless it is off)."""
    with _llm(True, kv_tokens=96, vision_embedding_cache_mib=embedding_cache_mib) as llm:
        seen = _count_tower_patches(llm)
        image = _image_prompt(llm, _image(0))
        first = llm.generate(image, _params(False))
        encoded = seen[0]
        assert encoded > 0
        again = llm.generate(image, _params(False))
        assert seen[0] == encoded, "the hit covers the image: no tower run"
        assert again.num_cached_tokens == _full_hit(len(again.prompt_token_ids))
        for text in OTHER_TEXTS:  # evict the image's KV blocks
            llm.generate(text, _params(False))
        late = llm.generate(image, _params(False))
        image_start = late.prompt_token_ids.index(llm.input_processor.image_token_id)
        assert late.num_cached_tokens <= image_start
        assert _ids(first) == _ids(again) == _ids(late) == reference["image-0"]
        cache = llm._executor.model_engine.model.vision_embedding_cache
        if embedding_cache_mib == 0:
            assert cache is None and seen[0] == 2 * encoded
        else:
            assert cache.hits == 1 and seen[0] == encoded


@pytest.mark.parametrize("reuse", [True, False])
def test_media_hashed_once_on_the_host_only_with_reuse(reuse: bool) -> None:
    from tensorrt_llm.inputs.media_hash import MULTIMODAL_HASHES
    from tensorrt_llm.inputs.registry import create_input_processor
    from tensorrt_llm.llmapi.input_preparer import InputPreparer
    from tensorrt_llm.llmapi.llm_args import LlmArgs

    ckpt = str(get_or_build_demo_checkpoint())
    args = LlmArgs(model=ckpt, device="cpu", enable_block_reuse=reuse)
    processor = create_input_processor(ckpt)
    preparer = InputPreparer(args, processor.tokenizer, processor, MAX_SEQ_LEN)
    prompt = processor.default_multimodal_prompt("Describe it.", num_images=1)
    prepared = preparer.prepare(
        {"prompt": prompt, "multi_modal_data": {"image": [_image(0)]}}, _params(False)
    )
    assert prepared.multimodal_params is not None
    hashes = prepared.multimodal_params.multimodal_data.get(MULTIMODAL_HASHES)
    assert (hashes is not None) == reuse
    if reuse:
        assert len(hashes["image"]) == 1 and len(bytes.fromhex(hashes["image"][0])) == 32


def test_n_completions_report_the_first_ones_hit(reference: dict) -> None:
    with _llm(True) as llm:
        llm.generate(TEXT, _params(False))
        params = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        out = llm.generate(TEXT, params)
        assert out.num_cached_tokens == _full_hit(len(out.prompt_token_ids))
        assert [list(o.token_ids) for o in out.outputs] == [reference["text-False"]] * 2


def test_prompt_logprobs_requests_take_no_hit() -> None:
    # Their logprobs need every prompt position's logits: a hit would skip positions.
    with _llm(None) as llm:
        plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        asking = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
        first = llm.generate(TEXT, asking)
        llm.generate(TEXT, plain)
        again = llm.generate(TEXT, asking)
        assert llm.generate(TEXT, plain).num_cached_tokens > 0  # the prompt is cached
        assert again.num_cached_tokens == 0
        assert len(again.prompt_logprobs) == len(again.prompt_token_ids)
        got = [
            None if e is None else {t: lp.logprob for t, lp in e.items()}
            for e in again.prompt_logprobs
        ]
        want = [
            None if e is None else {t: lp.logprob for t, lp in e.items()}
            for e in first.prompt_logprobs
        ]
        assert got == want
