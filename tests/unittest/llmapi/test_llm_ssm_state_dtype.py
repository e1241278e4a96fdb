"""`mamba_ssm_cache_dtype`: hybrid models' Gated DeltaNet state in 16 bits (CPU, tiny Qwen3.5).

The pools take the chosen dtype, the capacity arithmetic counts its bytes, and generation
stays close to the float32 state's: the kernels compute in float32 and round the state once
a step, so the log-probabilities of the same greedy tokens move by rounding only. A choice
for a model without recurrent state, or an unknown one, is an error. "auto" takes the
checkpoint's `mamba_ssm_dtype` (the Qwen3.5 / 3.6 releases set "float32").
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.capacity import recurrent_state_bytes_per_slot
from tensorrt_llm.llmapi import KvCacheConfig
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

PROMPTS = ["the quick brown fox jumps over the lazy dog", "once upon a time there was"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)


def _run(ssm_dtype: str) -> tuple[list[Any], dict[str, torch.Tensor]]:
    # (the engine's startup line names the state dtype: test_startup_line_names_the_state_dtype)
    with LLM(
        str(get_or_build_demo_checkpoint("qwen3_5")),
        device="cpu",
        executor_mode="inproc",
        max_batch_size=2,
        max_seq_len=64,
        kv_cache_config=KvCacheConfig(mamba_ssm_cache_dtype=ssm_dtype),
    ) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        state = llm._executor.model_engine.model.per_slot_state()
        return outputs, {name: t.detach().clone() for name, t in state.items()}


def test_bfloat16_state_pools_and_outputs_close_to_float32() -> None:
    ref, ref_state = _run("auto")
    got, state = _run("bfloat16")
    ssm = [n for n in state if ".ssm_" in n]
    assert ssm and all(state[n].dtype == torch.bfloat16 for n in ssm)
    assert all(ref_state[n].dtype == torch.float32 for n in ssm)
    # The conv state keeps the model dtype (float32 on the CPU) either way.
    assert all(state[n].dtype == ref_state[n].dtype for n in state if ".conv_" in n)
    for want, out in zip(ref, got, strict=True):
        ids = list(want.outputs[0].token_ids)
        assert list(out.outputs[0].token_ids) == ids
        lp_want = [want.outputs[0].logprobs[i][t].logprob for i, t in enumerate(ids)]
        lp_got = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(ids)]
        assert lp_got != lp_want  # the state really was rounded
        torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_want), atol=2e-2, rtol=0)


def test_capacity_counts_the_state_dtype() -> None:
    args = LlmArgs(model=str(get_or_build_demo_checkpoint("qwen3_5")))
    text = args.to_engine_config().text_config
    full = recurrent_state_bytes_per_slot(text, torch.float32)
    half = recurrent_state_bytes_per_slot(text, torch.float32, ssm_dtype=torch.bfloat16)
    k_dim, v_dim = text.linear_key_head_dim, text.linear_value_head_dim
    layers = sum(t == "linear_attention" for t in text.layer_types)
    assert full - half == layers * text.linear_num_value_heads * k_dim * v_dim * 2


def test_choice_errors() -> None:
    with pytest.raises(ValueError, match="no linear_attention layers"):
        LlmArgs(
            model=str(get_or_build_demo_checkpoint("qwen3_vl")), mamba_ssm_cache_dtype="bfloat16"
        ).to_engine_config()
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        LlmArgs(model=str(get_or_build_demo_checkpoint("qwen3_5")), mamba_ssm_cache_dtype="fp8")
    args = LlmArgs(
        model=str(get_or_build_demo_checkpoint("qwen3_5")),
        kv_cache_config={"mamba_ssm_cache_dtype": "float16"},
    )
    assert args.to_engine_config().ssm_state_dtype == torch.float16


def test_startup_line_names_the_state_dtype(caplog: pytest.LogCaptureFixture) -> None:
    from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
    from tensorrt_llm.inputs.registry import create_input_processor

    ckpt = str(get_or_build_demo_checkpoint("qwen3_5"))
    args = LlmArgs(model=ckpt, device="cpu", max_batch_size=2, mamba_ssm_cache_dtype="bfloat16")
    logger = "tensorrt_llm._torch.pyexecutor.py_executor_creator"
    with caplog.at_level(logging.INFO, logger=logger):
        create_py_executor(args.to_engine_config(), create_input_processor(ckpt)).shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready:")]
    assert len(lines) == 1 and lines[0].endswith(" ssm_state=bfloat16")


def _with_config_field(tmp_path: Path, where: str, value: str) -> str:
    """A copy of the tiny Qwen3.5 checkpoint whose config.json sets `mamba_ssm_dtype` in
    `where` ("text_config" or "top")."""
    src = get_or_build_demo_checkpoint("qwen3_5")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (cfg["text_config"] if where == "text_config" else cfg)["mamba_ssm_dtype"] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("where", ["text_config", "top"])
def test_auto_takes_the_checkpoints_mamba_ssm_dtype(tmp_path: Path, where: str) -> None:
    ckpt = _with_config_field(tmp_path, where, "bfloat16")
    assert LlmArgs(model=ckpt).to_engine_config().ssm_state_dtype == torch.bfloat16
    # An explicit choice wins over the checkpoint's.
    explicit = LlmArgs(model=ckpt, mamba_ssm_cache_dtype="float32").to_engine_config()
    assert explicit.ssm_state_dtype == torch.float32
    # Without the field "auto" stays float32.
    plain = LlmArgs(model=str(get_or_build_demo_checkpoint("qwen3_5"))).to_engine_config()
    assert plain.ssm_state_dtype == torch.float32


def test_unknown_checkpoint_mamba_ssm_dtype_is_an_error(tmp_path: Path) -> None:
    ckpt = _with_config_field(tmp_path, "text_config", "float8_e4m3fn")
    with pytest.raises(ValueError, match="mamba_ssm_dtype='float8_e4m3fn'"):
        LlmArgs(model=ckpt).to_engine_config()
    # The user can still override it.
    args = LlmArgs(model=ckpt, mamba_ssm_cache_dtype="float32")
    assert args.to_engine_config().ssm_state_dtype == torch.float32
