"""Prefix caching on hybrid models (Qwen3.5 dense and MoE tiny checkpoints, CPU): KV block
reuse plus recurrent-state snapshots at block boundaries.

A hit must change nothing but the work done: every request gives the greedy tokens it gives
with reuse off (a missing or wrong conv / SSM state restore changes them), while
`num_cached_tokens` says where the hit ended: at the last aligned point before the prompt's
last token for a repeat, in the previous answer for the next turn of a chat, before the image
for the same text with another image. Small KV caches and small snapshot pools evict; small
prefill chunks and a small KV cache preempt; outputs stay exact.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from PIL import Image

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.hybrid_kv_cache_reuse import (
    SNAPSHOT_SCRATCH_SLOTS,
    HybridKvCacheReuse,
    recurrent_slot_state,
)
from tensorrt_llm._torch.pyexecutor.state_snapshot_pool import RecurrentSnapshotPool
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

TPB = 4
MAX_TOKENS = 12
TEXT = "the quick brown fox jumps over the lazy dog and keeps on running far away"
OTHER_TEXTS = [f"story number {i}: once upon a time there was a tiny model" for i in range(5)]
NEXT_QUESTION = [5, 6, 7]


def _llm(reuse: bool | None, family: str = "qwen3_5", kv_tokens: int = 4096, **kw: Any) -> LLM:
    kv: dict[str, Any] = {"max_tokens": kv_tokens}
    if reuse is not None:
        kv["enable_block_reuse"] = reuse
    return LLM(
        str(get_or_build_demo_checkpoint(family)),
        device=kw.pop("device", "cpu"),
        executor_mode=kw.pop("executor_mode", "inproc"),
        max_batch_size=4,
        max_num_tokens=kw.pop("max_num_tokens", 64),
        max_seq_len=128,
        tokens_per_block=TPB,
        disable_overlap_scheduler=not kw.pop("overlap", True),
        kv_cache_config=kv,
        **kw,
    )


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _ids(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def _full_hit(prompt_len: int) -> int:
    return (prompt_len - 1) // TPB * TPB


def _image(seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (56, 84, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _image_prompt(llm: LLM, image: Image.Image) -> dict[str, Any]:
    prompt = llm.input_processor.default_multimodal_prompt("Describe it.", num_images=1)
    return {"prompt": prompt, "multi_modal_data": {"image": [image]}}


def _turn2(first: Any) -> dict[str, Any]:
    """The next turn of a chat: the whole history (prompt + answer) and a new question."""
    return {"prompt_token_ids": list(first.prompt_token_ids) + _ids(first) + NEXT_QUESTION}


def _reference(family: str, **kw: Any) -> dict[str, Any]:
    with _llm(False, family, **kw) as off:
        first = off.generate(TEXT, GREEDY)
        want: dict[str, Any] = {"text": _ids(first)}
        want["turn2"] = _ids(off.generate(_turn2(first), GREEDY))
        for i, text in enumerate(OTHER_TEXTS):
            want[f"other-{i}"] = _ids(off.generate(text, GREEDY))
        if family == "qwen3_5":
            for seed in (0, 1):
                want[f"image-{seed}"] = _ids(off.generate(_image_prompt(off, _image(seed)), GREEDY))
        assert off._executor.scheduler.reuse is None
    return want


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {family: _reference(family) for family in ("qwen3_5", "qwen3_5_moe")}


def _check_repeat_and_next_turn(llm: LLM, want: dict[str, Any]) -> None:
    first = llm.generate(TEXT, GREEDY)
    again = llm.generate(TEXT, GREEDY)
    assert _ids(first) == _ids(again) == want["text"]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == _full_hit(len(again.prompt_token_ids)) > 0
    follow = llm.generate(_turn2(first), GREEDY)
    assert _ids(follow) == want["turn2"]
    # The answer's last aligned point: its last token's KV and state were never computed.
    history = len(first.prompt_token_ids) + MAX_TOKENS
    assert follow.num_cached_tokens == (history - 1) // TPB * TPB > again.num_cached_tokens


@pytest.mark.parametrize(
    "family, overlap", [("qwen3_5", True), ("qwen3_5", False), ("qwen3_5_moe", True)]
)
def test_repeat_and_next_turn_match_reuse_off(family: str, overlap: bool, references: dict) -> None:
    with _llm(True, family, overlap=overlap) as llm:
        reuse = llm._executor.scheduler.reuse
        assert isinstance(reuse, HybridKvCacheReuse)
        _check_repeat_and_next_turn(llm, references[family])
        assert reuse.snapshots.stats.restored == 2
        reuse.snapshots.check_invariants()
        assert reuse.snapshots.num_pending == 0  # every finished request gave its entry back


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_snapshot_inside_the_chunk_keeps_one_prefill_step(family: str, references: dict) -> None:
    """The prompt-end snapshot point lies inside the prompt's one chunk: the prompt still
    prefills in one step (the state there is taken inside it, through a scratch seq slot),
    and the repeat and the next turn that hit it give the reuse-off tokens."""
    with _llm(True, family) as llm:
        executor = llm._executor
        reuse = executor.scheduler.reuse
        chunks: dict[int, list[tuple[int, int, Any]]] = {}
        register = reuse.register_step

        def spy(scheduled: Any) -> None:
            for r in scheduled.context_requests:
                row = (r.context_current_position, r.context_chunk_size, r.inner_snapshot)
                chunks.setdefault(r.request_id, []).append(row)
            register(scheduled)

        reuse.register_step = spy
        _check_repeat_and_next_turn(llm, references[family])
        first, again, follow = chunks.values()
        n = sum(again[0][:2])  # the prompt's length: the repeat runs from its hit to the end
        # Each prefill is one step: the first with its point inside (scratch: slot 4, the
        # first past the scheduler's 4), the repeat and the next turn from their hits.
        assert first == [(0, n, (_full_hit(n), 4))]
        assert len(again) == len(follow) == 1 and again[0][0] == _full_hit(n)
        assert executor.scheduler.seq_slot_manager.num_free == 4
        assert reuse.num_free_scratch_slots == SNAPSHOT_SCRATCH_SLOTS  # given back


def test_a_full_batch_snapshots_inside_each_chunk(references: dict) -> None:
    """Four prompts at once take all four scheduler slots: each still prefills in one step
    with its prompt-end state taken inside the chunk (scratch rows of their own), and the
    repeats that hit those snapshots give the reuse-off tokens."""
    want = references["qwen3_5"]
    texts = OTHER_TEXTS[:4]
    with _llm(True, max_num_tokens=256) as llm:
        executor = llm._executor
        reuse = executor.scheduler.reuse
        steps: list[list[tuple[int, Any]]] = []
        register = reuse.register_step

        def spy(scheduled: Any) -> None:
            rows = [(r.context_chunk_size, r.inner_snapshot) for r in scheduled.context_requests]
            if rows:
                steps.append(rows)
            register(scheduled)

        reuse.register_step = spy
        firsts = llm.generate(texts, GREEDY)
        assert [_ids(o) for o in firsts] == [want[f"other-{i}"] for i in range(4)]
        assert len(steps) == 1 and len(steps[0]) == 4  # every prompt in one step
        slots = sorted(inner[1] for _, inner in steps[0])
        assert slots == [4, 5, 6, 7]  # past the scheduler's slots 0..3
        again = llm.generate(texts, GREEDY)
        assert [_ids(o) for o in again] == [want[f"other-{i}"] for i in range(4)]
        assert [o.num_cached_tokens for o in again] == [
            _full_hit(len(o.prompt_token_ids)) for o in again
        ]


def test_process_mode_and_the_snapshot_knob(references: dict) -> None:
    """The engine in its own process: the knob crosses with the args; a pool too small for
    one snapshot is an error naming it."""
    with _llm(True, executor_mode="process", recurrent_state_snapshot_mib=1) as llm:
        first, again = (llm.generate(TEXT, GREEDY) for _ in range(2))
        assert _ids(first) == _ids(again) == references["qwen3_5"]["text"]
        assert again.num_cached_tokens == _full_hit(len(again.prompt_token_ids))


def test_snapshot_pool_smaller_than_one_snapshot_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tensorrt_llm._torch.pyexecutor import hybrid_kv_cache_reuse

    real = hybrid_kv_cache_reuse.RecurrentSnapshotPool

    def one_byte(state: Any, max_bytes: int, *rest: Any) -> RecurrentSnapshotPool:
        return real(state, 1, *rest)

    monkeypatch.setattr(hybrid_kv_cache_reuse, "RecurrentSnapshotPool", one_byte)
    with pytest.raises(ValueError, match="recurrent_state_snapshot_mib=0.0 holds no snapshot"):
        _llm(True)


def test_default_keeps_hybrid_reuse_off(references: dict) -> None:
    with _llm(None) as llm:
        assert llm._executor.scheduler.reuse is None
        assert not llm._executor.kv_cache_manager.enable_block_reuse
        again = [llm.generate(TEXT, GREEDY) for _ in range(2)][-1]
        assert again.num_cached_tokens == 0 and _ids(again) == references["qwen3_5"]["text"]


def test_another_image_hits_only_the_blocks_before_it(references: dict) -> None:
    want = references["qwen3_5"]
    with _llm(True) as llm:
        first = llm.generate(_image_prompt(llm, _image(0)), GREEDY)
        same = llm.generate(_image_prompt(llm, _image(0)), GREEDY)
        other = llm.generate(_image_prompt(llm, _image(1)), GREEDY)
        assert first.num_cached_tokens == 0
        assert same.num_cached_tokens == _full_hit(len(same.prompt_token_ids))
        image_start = same.prompt_token_ids.index(llm.input_processor.image_token_id)
        # The prefill snapshotted the state at the last block boundary before the image.
        assert 0 < other.num_cached_tokens == image_start // TPB * TPB < same.num_cached_tokens
        assert _ids(first) == _ids(same) == want["image-0"]
        assert _ids(other) == want["image-1"]
        # Qwen3.5 is a VL model: its vision-embedding cache works with reuse as before.
        cache = llm._executor.model_engine.model.vision_embedding_cache
        assert cache is not None and len(cache) == 2


def test_kv_eviction_drops_snapshots_and_keeps_outputs_exact(references: dict) -> None:
    want = references["qwen3_5"]
    with _llm(True, kv_tokens=96) as llm:
        reuse = llm._executor.scheduler.reuse
        first = llm.generate(OTHER_TEXTS[0], GREEDY)
        for i, text in enumerate(OTHER_TEXTS[1:], start=1):
            assert _ids(llm.generate(text, GREEDY)) == want[f"other-{i}"]
        assert llm._executor.kv_cache_manager.prefix_cache_stats.evictions > 0
        assert reuse.snapshots.stats.dropped > 0
        again = llm.generate(OTHER_TEXTS[0], GREEDY)
        assert _ids(first) == _ids(again) == want["other-0"]
        assert again.num_cached_tokens < _full_hit(len(again.prompt_token_ids))
        last = llm.generate(OTHER_TEXTS[0], GREEDY)
        assert last.num_cached_tokens == _full_hit(len(last.prompt_token_ids))
        assert _ids(last) == want["other-0"]
        reuse.snapshots.check_invariants()
        llm._executor.kv_cache_manager.pool.check_invariants()


def test_small_snapshot_pool_evicts_and_keeps_outputs_exact(references: dict) -> None:
    want = references["qwen3_5"]
    with _llm(True) as llm:
        executor = llm._executor
        old = executor.scheduler.reuse
        state = recurrent_slot_state(executor.model_engine.slot_state.model_state)
        # Three entries (a prompt's two prefill points and its pending decode entry): fewer
        # than the prompts below leave behind, so LRU eviction must run.
        small = RecurrentSnapshotPool(state, 3 * old.snapshots.bytes_per_snapshot)
        executor.scheduler.reuse = HybridKvCacheReuse(old.kv, small, old.spatial_merge_size)
        for _ in range(2):
            for i, text in enumerate(OTHER_TEXTS):
                assert _ids(llm.generate(text, GREEDY)) == want[f"other-{i}"]
        assert small.stats.evicted > 0
        _check_repeat_and_next_turn(llm, want)  # still hits: the newest snapshots are kept
        small.check_invariants()


def test_shared_prefix_hits_where_requests_part() -> None:
    """One long shared prefix, different questions: the second request finds the prefix's KV
    but no snapshot inside it, so it snapshots where it parts from the first; the third hits
    all of the shared blocks."""
    shared = 2 * 41 + 3  # not block-aligned: the hit stops at the block boundary below it
    prefix = [(7 * i) % 300 + 10 for i in range(shared)]
    prompts = [{"prompt_token_ids": prefix + [400 + q, 401, 402 + q] * 3} for q in range(3)]
    with _llm(False) as off:
        want = [_ids(off.generate(p, GREEDY)) for p in prompts]
    with _llm(True) as llm:
        outs = [llm.generate(p, GREEDY) for p in prompts]
        assert [_ids(o) for o in outs] == want
        assert outs[0].num_cached_tokens == outs[1].num_cached_tokens == 0
        assert outs[2].num_cached_tokens == shared // TPB * TPB


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_with_reuse_keeps_outputs_exact(overlap: bool) -> None:
    """Requests on one shared prefix in a pool too small for them all, with 8-token prefill
    chunks: hits, snapshot restores, chunking and recompute together give reuse-off tokens."""
    prefix = TEXT + " " + TEXT
    inputs = [f"{prefix} variant {i}" for i in range(6)]
    with _llm(False, max_num_tokens=8, kv_tokens=120, overlap=overlap) as off:
        want = [_ids(o) for o in off.generate(inputs, GREEDY)]
    with _llm(True, kv_tokens=120, max_num_tokens=8, overlap=overlap) as llm:
        llm.generate(inputs[0], GREEDY)  # the prefix is cached before the burst
        outs = llm.generate(inputs, GREEDY)
        assert [_ids(o) for o in outs] == want
        stats = llm.get_stats()
        assert stats.num_preemptions > 0, "the small pool must force preemptions"
        assert all(o.num_cached_tokens > 0 for o in outs)
        assert stats.num_free_kv_blocks == stats.num_total_kv_blocks
        reuse = llm._executor.scheduler.reuse
        assert reuse.snapshots.num_pending == 0
        reuse.snapshots.check_invariants()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_repeat_and_next_turn_match_reuse_off_on_cuda(family: str) -> None:
    """Device copies, the decode CUDA graphs reading the restored rows, fla's prefill kernels
    starting from them; float32 so the chunk split alone cannot flip a greedy token."""
    cuda = {"device": "cuda", "dtype": "float32"}
    want = _reference(family, **cuda)
    with _llm(True, family, **cuda) as llm:
        assert llm._executor.model_engine.cuda_graph_runner is not None
        _check_repeat_and_next_turn(llm, want)
        if family == "qwen3_5":
            first = llm.generate(_image_prompt(llm, _image(0)), GREEDY)
            other = llm.generate(_image_prompt(llm, _image(1)), GREEDY)
            assert _ids(first) == want["image-0"] and _ids(other) == want["image-1"]
            assert other.num_cached_tokens > 0


@pytest.mark.parametrize("flag", ["--enable_block_reuse", "--no-enable_block_reuse", None])
def test_serve_flag_and_yaml_knob_reach_the_engine_config(flag: str | None, tmp_path: Any) -> None:
    """`trtllm-serve --enable_block_reuse` on a hybrid checkpoint turns it on (no error any
    more); the snapshot bound comes from --extra_llm_api_options; unset keeps it off."""
    from tensorrt_llm.commands.serve import llm_kwargs, parse_args
    from tensorrt_llm.llmapi.llm_args import LlmArgs

    yaml = tmp_path / "extra.yaml"
    yaml.write_text("recurrent_state_snapshot_mib: 64\n", encoding="utf-8")
    model = str(get_or_build_demo_checkpoint("qwen3_5"))
    argv = ["serve", model, "--device", "cpu", "--extra_llm_api_options", str(yaml)]
    kwargs = llm_kwargs(parse_args(argv + ([flag] if flag else [])))
    config = LlmArgs.from_kwargs(model=model, **kwargs).to_engine_config()
    assert config.enable_block_reuse is (flag == "--enable_block_reuse")
    assert config.recurrent_state_snapshot_bytes == 64 * 2**20


def test_a_pool_too_small_for_a_full_batch_of_chats_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fewer than 3 snapshots a seq slot: a full batch of chats would evict what their next
    turns hit, so startup says so and names the knob (the CPU default holds plenty)."""
    name = "tensorrt_llm._torch.pyexecutor.hybrid_kv_cache_reuse"
    with caplog.at_level(logging.WARNING, logger=name), _llm(True) as llm:
        pool = llm._executor.scheduler.reuse.snapshots
        assert pool.capacity >= 3 * 4
    assert "snapshot pool holds" not in caplog.text
    entries = 2**20 // pool.bytes_per_snapshot  # what 1 MiB holds
    slots = entries // 3 + 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=name):
        with LLM(
            str(get_or_build_demo_checkpoint("qwen3_5")),
            device="cpu",
            executor_mode="inproc",
            max_batch_size=slots,
            max_seq_len=128,
            tokens_per_block=TPB,
            kv_cache_config={"enable_block_reuse": True, "max_tokens": 4096},
            recurrent_state_snapshot_mib=1,
        ) as llm:
            assert llm._executor.scheduler.reuse.snapshots.capacity == entries
    want = f"holds {entries} entries, fewer than 3 for each of the {slots} seq slots"
    need_mib = -(-3 * slots * pool.bytes_per_snapshot // 2**20)
    assert want in caplog.text and f"recurrent_state_snapshot_mib={need_mib} holds" in caplog.text
