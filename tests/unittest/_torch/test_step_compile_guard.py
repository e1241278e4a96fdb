"""The step compile guard: a compile or autotune on an armed thread fails only that step."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.step_compile_guard import (
    ENV_FAIL_ON_STEP_COMPILE,
    STEP_COMPILE_GUARD,
    StepCompileError,
    StepCompileGuard,
)
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.sampling_params import SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


def _in_thread(fn: Any) -> BaseException | None:
    """Run fn on a new thread, armed in the guard; returns what it raised."""
    raised: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            raised.append(exc)

    thread = threading.Thread(target=body)
    GUARD.arm(thread)
    thread.start()
    thread.join()
    return raised[0] if raised else None


GUARD = StepCompileGuard()


def test_armed_thread_raises_only_with_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    compile_ = lambda: GUARD.on_jit_compile(repr="_prefill_kernel[num_warps=4](T: i32)")  # noqa: E731
    monkeypatch.delenv(ENV_FAIL_ON_STEP_COMPILE, raising=False)
    assert _in_thread(compile_) is None  # off: only counted
    monkeypatch.setenv(ENV_FAIL_ON_STEP_COMPILE, "1")
    exc = _in_thread(compile_)
    assert isinstance(exc, StepCompileError) and "_prefill_kernel[num_warps=4]" in str(exc)
    exc = _in_thread(lambda: GUARD.on_autotune("fla.ops.chunk_fwd_kernel_o", (32, 128)))
    assert isinstance(exc, StepCompileError) and "chunk_fwd_kernel_o" in str(exc)
    assert "(32, 128)" in str(exc)
    # Warm-up runs on the creating thread, which is never armed.
    assert GUARD.on_jit_compile(repr="k") is False
    GUARD.on_autotune("k", (1,))
    assert GUARD.num_compiles == 3 and GUARD.num_autotunes == 2


def test_install_sets_and_chains_tritons_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    knobs = pytest.importorskip("triton").knobs
    earlier: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: earlier.append(kw["repr"]))
    guard = StepCompileGuard()
    guard.install()
    assert knobs.runtime.jit_cache_hook == guard.on_jit_compile
    assert knobs.runtime.jit_cache_hook(repr="k1") is False and earlier == ["k1"]
    guard.install()  # once per process
    assert knobs.runtime.jit_cache_hook == guard.on_jit_compile


def test_a_compile_inside_a_served_step_fails_that_step_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the real executor: a stand-in for Triton's hook fires inside the model's forward
    once; the step's request fails naming the kernel, the next request is served."""
    monkeypatch.setenv(ENV_FAIL_ON_STEP_COMPILE, "1")
    monkeypatch.setenv("TRTLLM_WARMUP", "1")  # warm-up on the CPU, then the loop is armed
    ckpt = str(write_tiny_checkpoint("qwen3", tmp_path))
    proc = create_input_processor(ckpt)
    args = LlmArgs(model=ckpt, device="cpu", max_batch_size=2, max_num_tokens=32)
    with caplog.at_level(logging.INFO, logger="tensorrt_llm._torch.pyexecutor.warmup"):
        executor = create_py_executor(args.to_engine_config(), proc)
    try:
        assert any(r.getMessage().startswith("warm-up: ") for r in caplog.records)
        model = executor.model_engine.model
        real = model.forward_batch
        fired: list[int] = []

        def forward_batch(batch: Any) -> Any:
            if not fired:
                fired.append(1)
                STEP_COMPILE_GUARD.on_jit_compile(repr="_fake_kernel[num_warps=4](rows: i32)")
            return real(batch)

        monkeypatch.setattr(model, "forward_batch", forward_batch)
        errors = []
        for rid in (1, 2):
            ids, _ = proc({"prompt": "hello there"}, None)
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            executor.enqueue_request(LlmRequest(rid, ids, params))
            while True:
                resp = executor.responses.get(timeout=60)
                if resp.finished:
                    errors.append(resp.error)
                    break
        assert errors[0] is not None and "StepCompileError" in errors[0]
        assert "_fake_kernel[num_warps=4]" in errors[0]
        assert errors[1] is None
    finally:
        executor.shutdown()
