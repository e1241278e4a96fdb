"""Startup: model build, the capacity probe (text-only AND multimodal dummies), KV sizing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.sampling_params import SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3")


def _start_and_generate(family: str, root: Path, device: str) -> list[int]:
    ckpt = str(write_tiny_checkpoint(family, root))
    proc = create_input_processor(ckpt)
    executor = create_py_executor(LlmArgs(model=ckpt, device=device).to_engine_config(), proc)
    try:
        # The probe ran a decode step on a seq slot; every slot and block is free again.
        assert executor.kv_cache_manager.num_used_blocks == 0
        assert executor.seq_slot_manager.num_free == executor.scheduler.max_batch_size
        assert executor.scheduler.max_batch_size == (8 if device == "cpu" else 512)  # sized
        ids, extra = proc({"prompt": "hello there, how are you"}, None)
        params = MultimodalParams(extra.get("multimodal_data", {})) if extra else None
        req = LlmRequest(
            1,
            ids,
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
            multimodal_params=params,
        )
        executor.enqueue_request(req)
        responses = []
        while True:
            resp = executor.responses.get(timeout=60)
            responses.append(resp)
            if resp.finished:
                break
        assert responses[-1].error is None
        assert req.finish_reason == "length"
        return list(req.output_token_ids)
    finally:
        executor.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_then_text_only_generation(family: str, tmp_path: Path) -> None:
    tokens = _start_and_generate(family, tmp_path, "cpu")
    assert len(tokens) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_probe_then_text_only_generation_cuda(family: str, tmp_path: Path) -> None:
    assert torch.cuda.is_available()
    tokens = _start_and_generate(family, tmp_path, "cuda")
    assert len(tokens) == 4


def test_startup_logs_one_summary_line(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    from tensorrt_llm.inputs.registry import create_input_processor
    from tensorrt_llm.llmapi.llm_args import LlmArgs
    from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

    ckpt = str(get_or_build_demo_checkpoint())
    with caplog.at_level(logging.INFO, logger="tensorrt_llm._torch.pyexecutor.py_executor_creator"):
        executor = create_py_executor(
            LlmArgs(model=ckpt, device="cpu", max_batch_size=2).to_engine_config(),
            create_input_processor(ckpt),
        )
    executor.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready:")]
    assert len(lines) == 1
    line = lines[0]
    for part in (
        "architecture=Qwen2VLForConditionalGeneration",
        "dtype=float32",
        "device=cpu",
        "max_batch_size=2",
        "kv_cache=",
        "decode_graphs=off",
        "quantization=none",
    ):
        assert part in line, (part, line)
