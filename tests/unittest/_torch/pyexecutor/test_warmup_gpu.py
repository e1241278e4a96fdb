"""GPU: after the warm-up no served step compiles or autotunes, and a second start reads the
tuned configs from disk. Each start is a fresh process (this file run as a script), since the
point is what a new process has to compile and tune."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Prompt lengths across size classes (1, multiples of 16 and neighbours, past max_num_tokens:
# chunked prefill), and waves of concurrent requests (mixed steps, decode batches).
LENGTHS = (1, 2, 3, 15, 16, 17, 31, 33, 64, 100, 127, 128, 129, 255, 300, 511, 700, 1000)
WAVES = (1, 3, 8, 18, 5)
MAX_BATCH, MAX_TOKENS = 24, 512
_REPORT = re.compile(
    r"warm-up: (\d+) steps .* startup: (\d+) Triton compiles, (\d+) autotune benchmarks, "
    r"(\d+) tuned configs read"
)


# MTP with three drafts a step: the verify rows, the head's passes and (the tiny head's
# drafts are mostly rejected) the rollback run in served steps too.
_MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}


def _serve(ckpt: str, mtp: bool = False) -> dict[str, Any]:
    """Child process: start the engine with the compile guard on, serve the waves."""
    from tensorrt_llm._torch.modules.gated_delta_rule import fla_available
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
    from tensorrt_llm.inputs.multimodal import MultimodalParams
    from tensorrt_llm.inputs.registry import create_input_processor
    from tensorrt_llm.llmapi.llm_args import LlmArgs
    from tensorrt_llm.sampling_params import SamplingParams

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tensorrt_llm._torch.pyexecutor.warmup").addHandler(handler)
    logging.getLogger("tensorrt_llm._torch.pyexecutor.warmup").setLevel(logging.INFO)
    proc = create_input_processor(ckpt)
    args = LlmArgs(
        model=ckpt,
        device="cuda",
        max_batch_size=MAX_BATCH,
        max_num_tokens=MAX_TOKENS,
        speculative_config=_MTP if mtp else None,
    )
    executor = create_py_executor(args.to_engine_config(), proc)
    errors: list[str] = []
    rid = 0
    try:
        for w, wave in enumerate(WAVES):
            reqs = []
            for i in range(wave):
                n = LENGTHS[(w * 7 + i) % len(LENGTHS)]
                ids, extra = proc({"prompt_token_ids": proc.get_dummy_prompt(n)}, None)
                mm = MultimodalParams(extra["multimodal_data"]) if extra else None
                rid += 1
                params = SamplingParams(max_tokens=3 + i % 5, temperature=0.0, ignore_eos=True)
                reqs.append(LlmRequest(rid, ids, params, multimodal_params=mm))
            for req in reqs:
                executor.enqueue_request(req)
            done = 0
            while done < len(reqs):
                resp = executor.responses.get(timeout=300)
                if resp.error is not None:
                    errors.append(resp.error)
                done += resp.finished
    finally:
        executor.shutdown()
    match = next(m for m in map(_REPORT.search, lines) if m)
    steps, compiles, autotunes, loaded = map(int, match.groups())
    return {
        "errors": errors,
        "steps": steps,
        "compiles": compiles,
        "autotunes": autotunes,
        "loaded": loaded,
        "fla": fla_available(),
    }


def _start(ckpt: Path, cache_dir: Path, mtp: bool = False) -> dict[str, Any]:
    env = dict(os.environ, TRTLLM_FAIL_ON_STEP_COMPILE="1", TRTLLM_CACHE_DIR=str(cache_dir))
    out = subprocess.run(
        [sys.executable, __file__, str(ckpt), *(["mtp"] if mtp else [])],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_no_step_compiles_after_warmup_and_second_start_reads_cache(
    family: str, tmp_path: Path
) -> None:
    import torch

    from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

    assert torch.cuda.is_available()
    # Triton specializes pointers on 16-byte alignment. Real models' per-token rows are all
    # wider than 16 bytes, so a row offset never changes it; the tiny default's 4 value heads
    # give 8-byte bf16 rows (beta), whose slices' alignment would flip with the offset parity.
    ckpt = write_tiny_checkpoint(
        family, tmp_path / "ckpt", text_config={"linear_num_value_heads": 8}
    )
    first = _start(ckpt, tmp_path / "cache")
    assert first["errors"] == [] and first["steps"] > 0
    second = _start(ckpt, tmp_path / "cache")
    assert second["errors"] == []
    assert second["autotunes"] == 0  # every key came from the disk cache
    if first["fla"]:
        assert first["autotunes"] > 0 and second["loaded"] >= first["autotunes"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_no_step_compiles_with_mtp_speculation(family: str, tmp_path: Path) -> None:
    from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(
        family,
        tmp_path / "ckpt",
        text_config={"linear_num_value_heads": 8},
        mtp_num_hidden_layers=1,
    )
    served = _start(ckpt, tmp_path / "cache", mtp=True)
    # The distinct errors, one a line: each names what compiled inside which step.
    assert served["errors"] == [], "\n".join(sorted(set(served["errors"])))
    assert served["steps"] > 0


@pytest.mark.gpu
def test_a_real_compile_in_a_served_step_fails_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton's own hook, not a stand-in: a kernel first launched inside a served step
    compiles there, and the flag turns that into the step's error."""
    import torch
    import triton
    import triton.language as tl

    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
    from tensorrt_llm.inputs.registry import create_input_processor
    from tensorrt_llm.llmapi.llm_args import LlmArgs
    from tensorrt_llm.sampling_params import SamplingParams
    from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

    @triton.jit
    def _never_warmed_kernel(x_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)

    monkeypatch.setenv("TRTLLM_FAIL_ON_STEP_COMPILE", "1")
    monkeypatch.setenv("TRTLLM_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = str(write_tiny_checkpoint("qwen3", tmp_path / "ckpt"))
    proc = create_input_processor(ckpt)
    args = LlmArgs(model=ckpt, device="cuda", max_batch_size=4, max_num_tokens=256)
    executor = create_py_executor(args.to_engine_config(), proc)
    try:
        model = executor.model_engine.model
        real = model.forward_batch
        scratch = torch.zeros(16, device="cuda")

        def forward_batch(batch: Any) -> Any:
            _never_warmed_kernel[(1,)](scratch, BLOCK=16)
            return real(batch)

        monkeypatch.setattr(model, "forward_batch", forward_batch)
        errors = []
        for rid in (1, 2):
            ids, _ = proc({"prompt": "hello there"}, None)
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            executor.enqueue_request(LlmRequest(rid, ids, params))
            while True:
                resp = executor.responses.get(timeout=120)
                if resp.finished:
                    errors.append(resp.error)
                    break
            monkeypatch.setattr(model, "forward_batch", real)
        assert errors[0] is not None and "_never_warmed_kernel" in errors[0], errors
        assert errors[1] is None
    finally:
        executor.shutdown()


if __name__ == "__main__":
    print(json.dumps(_serve(sys.argv[1], mtp=sys.argv[2:] == ["mtp"])))
