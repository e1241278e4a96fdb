"""The README's serving example runs as written: its server line (port and local-media folder
substituted), the /health poll, and its curl request, in bash."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(
        r"With `--demo` it serves the tiny demo checkpoint:\n\n```bash\n(.*?)```", text, re.S
    )
    assert block is not None, "the README lost its serving example"
    return block.group(1)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the example uses curl")
def test_readme_serve_example_runs(tmp_path: Path) -> None:
    script = _example()
    assert "until curl -sf http://localhost:8000/health" in script  # polls, no fixed sleep
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = script.replace("8000", str(port)).replace(
        "--allowed_local_media_path /tmp", f"--allowed_local_media_path {tmp_path}"
    )
    # The server line runs in the background; the test adds a CPU device and a deadline to
    # the poll, and stops the server afterwards.
    script = script.replace("trtllm-serve --demo", "trtllm-serve --demo --device cpu", 1)
    script = script.replace(
        "do sleep 1; done", "do sleep 1; n=$((n+1)); [ $n -gt 180 ] && exit 3; done"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        ["bash", "-c", "set -m\n" + script + "\nkill %1; wait"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    body = json.loads(out.strip().splitlines()[-1])
    assert body["object"] == "chat.completion", err[-2000:]
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1
