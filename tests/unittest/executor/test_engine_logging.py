"""The engine process logs at the front end's level and in its format: its startup summary
line shows under trtllm-serve's --log_level (and any logging the LLM API user set up)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint


def _run(level: str) -> str:
    script = textwrap.dedent(
        f"""
        import logging
        logging.basicConfig(level=logging.{level}, format="ENGINE-TEST %(levelname)s %(message)s")
        from tensorrt_llm import LLM, SamplingParams
        with LLM({str(get_or_build_demo_checkpoint())!r}, device="cpu") as llm:
            llm.generate("hi", SamplingParams(max_tokens=1))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


def test_engine_child_logs_like_the_front_end() -> None:
    assert "ENGINE-TEST INFO engine ready: " in _run("INFO")
    assert "engine ready:" not in _run("WARNING")
