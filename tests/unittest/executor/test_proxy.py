"""executor_mode="process": the engine in a child process behaves like the in-process engine.

Real processes on the tiny demo checkpoint (CPU): greedy text, image, streaming, n > 1 and
abort give what executor_mode="inproc" gives; large tensors cross through shared memory and
leave nothing in /dev/shm; killing the engine fails pending requests fast with a clear error;
no child survives shutdown().
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.executor import ipc
from tensorrt_llm.llmapi import PromptTooLongError
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
KWARGS: dict[str, Any] = dict(
    max_batch_size=4,
    max_num_tokens=512,
    max_seq_len=512,
    kv_cache_max_tokens=4096,
    tokens_per_block=16,
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too; Popen reaps it on poll() or wait().
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return get_or_build_demo_checkpoint("qwen2_vl")


@pytest.fixture(scope="module")
def inproc(ckpt: Path) -> Any:
    with LLM(str(ckpt), executor_mode="inproc", **KWARGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def proc(ckpt: Path) -> Any:
    with LLM(str(ckpt), executor_mode="process", **KWARGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def image() -> Image.Image:
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (112, 140, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _image_prompt(llm: Any, image: Image.Image) -> dict[str, Any]:
    return {
        "prompt": llm.input_processor.default_multimodal_prompt("What is it?", num_images=1),
        "multi_modal_data": {"image": [image]},
    }


def _ids(outputs: Any) -> list[list[int]]:
    return [[o.token_ids for o in out.outputs] for out in outputs]


def test_greedy_text_matches_inproc(inproc: Any, proc: Any) -> None:
    prompts = ["hello world", "a b c d e", "Once upon a time"]
    want = inproc.generate(prompts, GREEDY)
    got = proc.generate(prompts, GREEDY)
    assert _ids(got) == _ids(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].finish_reason for o in got] == ["length"] * 3


def test_image_matches_inproc_through_shared_memory(
    inproc: Any, proc: Any, image: Image.Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    created: list[str] = []
    new_segment = ipc._new_segment

    def spy(nbytes: int) -> Any:
        segment = new_segment(nbytes)
        created.append(segment.name)
        return segment

    monkeypatch.setattr(ipc, "_new_segment", spy)
    want = inproc.generate(_image_prompt(inproc, image), GREEDY)
    got = proc.generate(_image_prompt(proc, image), GREEDY)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert created  # the pixels (> 64 KiB) went through shared memory
    prefix = ipc.shm_name_prefix()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def test_streaming_and_stop_strings_match_inproc(inproc: Any, proc: Any) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = inproc.generate("stream this", params)

    async def stream() -> tuple[list[int], str, int]:
        handle = proc.generate_async("stream this", params, streaming=True)
        ids, text, updates = [], "", 0
        async for part in handle:
            ids += part.outputs[0].token_ids_diff
            text += part.outputs[0].text_diff
            updates += 1
        return ids, text, updates

    ids, text, updates = asyncio.run(stream())
    assert updates > 1
    assert ids == want.outputs[0].token_ids and text == want.outputs[0].text
    # Stop strings are checked by the engine process's own tokenizer.
    full = want.outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if stop.strip() and "\ufffd" not in stop:
        sp = SamplingParams(max_tokens=12, temperature=0.0, stop=[stop])
        assert proc.generate("stream this", sp).outputs[0].text == (
            inproc.generate("stream this", sp).outputs[0].text
        )


def test_n_seed_and_abort(inproc: Any, proc: Any) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2)
    assert _ids([proc.generate("random", params)]) == _ids([inproc.generate("random", params)])
    handle = proc.generate_async("abort me", SamplingParams(max_tokens=400, temperature=0.0))
    handle.abort()
    out = handle.result(timeout=30)
    assert out.outputs[0].finish_reason == "cancelled"
    assert len(out.outputs[0].token_ids) < 400


def test_limits_and_stats_come_from_the_engine(inproc: Any, proc: Any) -> None:
    assert proc.max_seq_len == inproc.max_seq_len
    with pytest.raises(PromptTooLongError) as want:
        inproc.generate("x", SamplingParams(max_tokens=600))
    with pytest.raises(PromptTooLongError) as got:
        proc.generate("x", SamplingParams(max_tokens=600))
    assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="prompt token ids must lie in"):
        proc.generate({"prompt_token_ids": [10**7]}, GREEDY)
    before = proc.get_stats()
    proc.generate("count me", GREEDY)
    stats = proc.get_stats()
    ref = inproc.get_stats()
    assert stats.num_completed == before.num_completed + 1
    assert stats.num_running == 0 and stats.num_free_seq_slots == stats.num_total_seq_slots
    assert (stats.num_total_seq_slots, stats.num_total_kv_blocks) == (
        ref.num_total_seq_slots,
        ref.num_total_kv_blocks,
    )


def test_shutdown_leaves_no_child(proc: Any) -> None:
    pid = proc._executor.pid
    assert _alive(pid) and proc._executor.is_alive
    executor = proc._executor
    proc.shutdown()
    assert not _alive(pid)
    # A clean exit: no abort in the engine's interpreter shutdown (e.g. a thread inside stdin).
    assert executor._process.returncode == 0
    assert not executor.is_alive
    assert proc.get_stats().num_completed > 0  # final stats survive the engine
    with pytest.raises(RuntimeError, match="shut down"):
        proc.generate("late", GREEDY)


def test_kill_fails_pending_requests_fast(ckpt: Path) -> None:
    llm = LLM(str(ckpt), executor_mode="process", **KWARGS)
    try:
        executor = llm._executor
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        handles = [llm.generate_async(f"long {i}", long) for i in range(3)]
        time.sleep(0.3)
        os.kill(executor.pid, signal.SIGKILL)
        start = time.monotonic()
        outs = [h.result(timeout=10) for h in handles]
        assert time.monotonic() - start < 5.0
        for out in outs:
            assert out.error == "engine process died (exit code -9)"
            assert out.outputs[0].finish_reason == "error"
        assert not executor.is_alive
        with pytest.raises(RuntimeError, match="engine process died"):
            llm.generate("after", GREEDY)
    finally:
        llm.shutdown()


def test_request_after_death_names_the_exit_code_before_the_receiver_notices(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(ckpt), executor_mode="process", **KWARGS)
    try:
        executor = llm._executor
        held = threading.Event()
        original = executor._receive_once

        def hold_receiver() -> bool:
            held.wait(timeout=30)
            return original()

        # The receiver thread looks the method up on every turn: from its next turn it waits.
        monkeypatch.setattr(executor, "_receive_once", hold_receiver)
        time.sleep(0.2)
        os.kill(executor.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while executor._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # zmq drops the dead peer: sends now fail instead of queueing
        assert not executor.is_alive
        with pytest.raises(RuntimeError, match=r"engine process died \(exit code -9\)"):
            llm.generate("after", GREEDY)
        held.set()
    finally:
        llm.shutdown()


def test_startup_error_reaches_the_caller(ckpt: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    for shard in broken.glob("*.safetensors"):
        shard.write_bytes(b"not a safetensors file")
    with pytest.raises(Exception) as want:
        LLM(str(broken), executor_mode="inproc", **KWARGS)
    with pytest.raises(Exception) as got:
        LLM(str(broken), executor_mode="process", **KWARGS)
    assert type(got.value) is type(want.value)
    assert str(got.value) == str(want.value)
