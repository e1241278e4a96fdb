"""A user script that builds `LLM(...)` at module top level, with no main guard, just works.

The default executor mode starts the engine process; a multiprocessing spawn would re-import
the script's `__main__` there and build a second LLM inside the engine process (which then
fails to start). The engine's child is a fresh `python -m tensorrt_llm.executor.worker`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tensorrt_llm
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

_SCRIPT = """
import sys
from tensorrt_llm import LLM, SamplingParams

llm = LLM(sys.argv[1], max_batch_size=2, max_seq_len=256, kv_cache_max_tokens=1024,
          tokens_per_block=16)
assert llm.args.executor_mode == "process"
out = llm.generate("hello world", SamplingParams(max_tokens=4, temperature=0.0))
assert len(out.outputs[0].token_ids) == 4, out
print("TEXT:" + repr(out.outputs[0].text), flush=True)
"""


def test_script_without_main_guard_runs_in_process_mode(tmp_path: Path) -> None:
    ckpt = get_or_build_demo_checkpoint("qwen2_vl")
    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT)
    # The package as this test imports it (installed or a checkout on the path).
    package_root = str(Path(tensorrt_llm.__file__).resolve().parents[1])
    path = os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run(
        [sys.executable, str(script), str(ckpt)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # Once: a re-imported __main__ would print (or fail) a second time in the engine process.
    assert done.stdout.count("TEXT:") == 1, done.stdout
    # Interpreter exit stops the engine; that is no crash to report.
    assert "engine process died" not in done.stderr, done.stderr[-4000:]
