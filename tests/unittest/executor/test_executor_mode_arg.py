"""LlmArgs.executor_mode: validated like the other choice fields; its own process by default."""

from __future__ import annotations

import pytest

from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint


def test_executor_mode_choices() -> None:
    model = str(get_or_build_demo_checkpoint("qwen2_vl"))
    assert LlmArgs(model=model).executor_mode == "process"
    assert LlmArgs(model=model, executor_mode="inproc").executor_mode == "inproc"
    with pytest.raises(ValueError, match=r"executor_mode must be one of \['inproc', 'process'\]"):
        LlmArgs(model=model, executor_mode="thread")
