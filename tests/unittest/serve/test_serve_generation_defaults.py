"""trtllm-serve applies the checkpoint's generation_config.json to fields a request omits.

A tiny checkpoint whose generation_config says do_sample=false: chat and text completions
without a temperature decode greedily whatever their seed, explicit temperatures still sample,
and --generation_config ignore restores the built-in sampling default. The server prepares its
inputs in a preprocess worker, which reads the defaults on its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import ServeHandle, start_server

from tensorrt_llm.commands.serve import llm_kwargs, parse_args
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

SEEDS = (1, 2, 3)
FLAGS = ["--device", "cpu", "--max_seq_len", "128", "--max_batch_size", "4"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeHandle]:
    ckpt = write_tiny_checkpoint(
        "qwen2", tmp_path_factory.mktemp("greedy"), generation_config={"do_sample": False}
    )
    handle = start_server([str(ckpt), *FLAGS, "--num_preprocess_workers", "1"])
    try:
        yield handle
    finally:
        handle.stop()


def _chat(handle: ServeHandle, **fields: Any) -> str:
    out = handle.client().chat.completions.create(
        model=handle.model,
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
        **fields,
    )
    return out.choices[0].message.content or ""


def _completion(handle: ServeHandle, **fields: Any) -> str:
    out = handle.client().completions.create(
        model=handle.model,
        prompt="once upon a time",
        max_tokens=8,
        extra_body={"ignore_eos": True},
        **fields,
    )
    return out.choices[0].text


@pytest.mark.parametrize("ask", [_chat, _completion], ids=["chat", "completions"])
def test_omitted_temperature_takes_the_checkpoints_greedy(served: ServeHandle, ask: Any) -> None:
    greedy = ask(served, temperature=0.0)
    assert [ask(served, seed=s) for s in SEEDS] == [greedy] * len(SEEDS)
    hot = {ask(served, seed=s, temperature=1.0) for s in SEEDS}
    assert len(hot) > 1  # a request's own temperature wins over the default


def test_generation_config_flag() -> None:
    args = parse_args(["ckpt", "--generation_config", "ignore"])
    assert llm_kwargs(args) == {"generation_config": "ignore"}
    assert "generation_config" not in llm_kwargs(parse_args(["ckpt"]))  # LLM's default: auto
    with pytest.raises(SystemExit):
        parse_args(["ckpt", "--generation_config", "vllm"])


def test_ignore_flag_samples_by_default(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen2", tmp_path, generation_config={"do_sample": False})
    handle = start_server([str(ckpt), *FLAGS, "--generation_config", "ignore"])
    try:
        texts = {_completion(handle, seed=s) for s in SEEDS}
    finally:
        handle.stop()
    assert len(texts) > 1  # the built-in temperature 1.0 samples
