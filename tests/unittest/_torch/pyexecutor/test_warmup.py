"""The startup warm-up on the CPU: it runs every planned step through the real engine, covers
every step the engine's limits allow, and leaves no trace in what the engine serves."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm._torch.modules.gated_delta_net_rows import RECURRENT_ROWS_MAX_TOKENS
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.warmup import (
    ENV_WARMUP,
    run_warmup,
    step_limits,
    warmup_enabled,
)
from tensorrt_llm._torch.pyexecutor.warmup_shapes import (
    StepShape,
    covered_features,
    features,
    warmup_steps,
)
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.sampling_params import SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

PROMPTS = ("hello there, how are you", "one two three four five six seven eight nine ten")


def _start(
    ckpt: str, monkeypatch: pytest.MonkeyPatch, warm: bool, **kwargs: Any
) -> tuple[Any, Any]:
    monkeypatch.setenv(ENV_WARMUP, "1" if warm else "0")
    proc = create_input_processor(ckpt)
    sizes = {"max_batch_size": 3, "max_num_tokens": 40, **kwargs}
    args = LlmArgs(model=ckpt, device="cpu", **sizes)
    return create_py_executor(args.to_engine_config(), proc), proc


def _generate(executor: Any, proc: Any) -> list[list[int]]:
    reqs = []
    for rid, prompt in enumerate(PROMPTS):
        ids, extra = proc({"prompt": prompt}, None)
        mm = MultimodalParams(extra["multimodal_data"]) if extra else None
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        req = LlmRequest(rid + 1, ids, params, multimodal_params=mm)
        reqs.append(req)
        executor.enqueue_request(req)
    done = 0
    while done < len(reqs):
        resp = executor.responses.get(timeout=120)
        assert resp.error is None, resp.error
        done += resp.finished
    return [list(r.output_token_ids) for r in reqs]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])  # hybrid state; mRoPE deltas
def test_warmup_leaves_no_trace(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = str(write_tiny_checkpoint(family, tmp_path))
    executor, proc = _start(ckpt, monkeypatch, warm=False)
    try:
        cold = _generate(executor, proc)
    finally:
        executor.shutdown()
    with caplog.at_level(logging.INFO, logger="tensorrt_llm._torch.pyexecutor.warmup"):
        executor, proc = _start(ckpt, monkeypatch, warm=True)
    try:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
        assert len(lines) == 1 and " (0 skipped" in lines[0], lines
        # Every block and seq slot the warm-up took is free again.
        assert executor.kv_cache_manager.num_used_blocks == 0
        assert executor.seq_slot_manager.num_free == executor.scheduler.max_batch_size
        assert _generate(executor, proc) == cold
    finally:
        executor.shutdown()


@pytest.mark.parametrize(
    "family, sizes",
    [
        ("qwen3", {}),
        ("qwen3", {"max_seq_len": 24}),  # long steps are several requests
        ("qwen3", {"max_batch_size": 7, "max_num_tokens": 5}),  # more rows than tokens
        ("qwen3_5", {"max_batch_size": 7, "max_num_tokens": 20}),  # hybrid: `rows` steps
    ],
    ids=str,
)
def test_warmup_runs_steps_covering_every_possible_step(
    family: str, sizes: dict[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shapes the engine really ran (recorded at `engine.run`), against a brute-force
    enumeration of the steps this engine's limits allow."""
    ckpt = str(write_tiny_checkpoint(family, tmp_path))
    executor, proc = _start(ckpt, monkeypatch, warm=False, **sizes)
    try:
        engine: PyTorchModelEngine = executor.model_engine
        limits = step_limits(engine, executor.scheduler.max_batch_size, executor.max_seq_len)
        want = (sizes.get("max_num_tokens", 40), sizes.get("max_batch_size", 3))
        assert (limits.max_num_tokens, limits.max_batch_size) == want
        ran: list[StepShape] = []
        real = engine.run

        def run(batch: Any) -> Any:
            md = batch.attn_metadata
            cached = md.num_cached_tokens_cpu[: md.num_contexts]
            lens = md.seq_lens_cpu[: md.num_contexts]
            carried = bool(cached.any())
            rows = md.num_contexts > 0 and bool((cached > 0).all())
            rows = rows and bool((lens <= RECURRENT_ROWS_MAX_TOKENS).all())
            shape = StepShape(md.num_ctx_tokens, md.num_contexts, md.num_generations, carried, rows)
            ran.append(shape)
            return real(batch)

        monkeypatch.setattr(engine, "run", run)
        report = run_warmup(
            engine, proc, executor.kv_cache_manager, limits.max_batch_size, executor.max_seq_len
        )
        assert report.steps_run == len(warmup_steps(limits)) and report.steps_skipped == 0
        assert report.autotunes == 0 and report.cache_path is None  # CPU: nothing tunes
        needed: set[tuple] = set()
        for ctx in range(limits.max_num_tokens + 1):
            for gen in range(limits.max_batch_size + 1):
                shapes = [StepShape(ctx, limits.min_contexts(ctx), gen, c) for c in (False, True)]
                shapes.append(StepShape(ctx, ctx, gen, True, True))  # one-token rows
                for shape in shapes:
                    if limits.is_possible(shape):
                        needed |= features(limits, shape)
        assert needed <= covered_features(limits, ran)
        if limits.recurrent_rows:  # the rows kernel's extremes: one row and the most rows
            counts = {shape.num_contexts for shape in ran if shape.rows}
            most = min(limits.max_batch_size, limits.max_num_tokens)
            assert {1, most} <= counts, counts
    finally:
        executor.shutdown()


def test_warmup_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv(ENV_WARMUP, raising=False)
    assert warmup_enabled(torch.device("cuda")) and not warmup_enabled(torch.device("cpu"))
    monkeypatch.setenv(ENV_WARMUP, "0")
    assert not warmup_enabled(torch.device("cuda"))
    monkeypatch.setenv(ENV_WARMUP, "1")
    assert warmup_enabled(torch.device("cpu"))
    monkeypatch.setenv(ENV_WARMUP, "yes")
    with pytest.raises(ValueError, match="TRTLLM_WARMUP must be 0 or 1"):
        warmup_enabled(torch.device("cpu"))


def test_steps_beyond_the_kv_cache_are_skipped_and_leave_nothing_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = str(write_tiny_checkpoint("qwen3", tmp_path))
    # 64 tokens of KV: a 40-token chunk plus two generation rows' blocks do not all fit.
    executor, proc = _start(ckpt, monkeypatch, warm=False, kv_cache_max_tokens=64)
    try:
        kv = executor.kv_cache_manager
        free = kv.num_free_blocks
        report = run_warmup(executor.model_engine, proc, kv, 3, executor.max_seq_len)
        assert report.steps_skipped > 0 and report.steps_run > 0
        assert kv.num_free_blocks == free and kv.num_used_blocks == 0
        assert _generate(executor, proc)  # still serves
    finally:
        executor.shutdown()
