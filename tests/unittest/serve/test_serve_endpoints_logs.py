"""GET /v1/models/{id} and /version; the server's log level and format (ours and uvicorn's),
and the reason of every 4xx logged at INFO."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import ServeHandle, user

import tensorrt_llm
from tensorrt_llm.serve.log_config import LOG_FORMAT

# LOG_FORMAT's lines: "2025-01-02 10:00:00,123 INFO uvicorn.access: ..."
_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: "
)


def test_model_by_id(served: ServeHandle) -> None:
    listed = httpx.get(served.base_url + "/v1/models", timeout=10).json()["data"][0]
    one = httpx.get(f"{served.base_url}/v1/models/{served.model}", timeout=10)
    assert one.status_code == 200
    card = one.json()
    assert card["id"] == served.model and card["object"] == "model"
    assert {k: v for k, v in card.items() if k != "created"} == {
        k: v for k, v in listed.items() if k != "created"
    }
    assert served.client().models.retrieve(served.model).id == served.model
    for other in ("gpt-4o", "Qwen/Qwen3-VL-8B-Instruct"):
        missing = httpx.get(f"{served.base_url}/v1/models/{other}", timeout=10)
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
        assert repr(other) in error["message"] and error["param"] == "model"


def test_version(served: ServeHandle) -> None:
    answer = httpx.get(served.base_url + "/version", timeout=10)
    assert answer.status_code == 200
    assert answer.json() == {"version": tensorrt_llm.__version__}
    assert re.match(r"^\d+\.\d+", tensorrt_llm.__version__)


def test_client_error_reason_logged(served: ServeHandle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorrt_llm.serve.http_responses")
    body = {"model": "nope", "messages": user("hi"), "max_tokens": 2}
    answer = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400
    httpx.get(served.base_url + "/v1/models/nope", timeout=10)
    lines = [
        r.getMessage() for r in caplog.records if r.name == "tensorrt_llm.serve.http_responses"
    ]
    reason = answer.json()["error"]["message"]
    assert f"POST /v1/chat/completions 400: {reason}" in lines
    assert any(line.startswith("GET /v1/models/nope 404: ") for line in lines)
    levels = {r.levelno for r in caplog.records if r.name == "tensorrt_llm.serve.http_responses"}
    assert levels == {logging.INFO}
    assert all("\n" not in line and "messages" not in line for line in lines)  # no body dump


_LOGGING_PROBE = """
import logging, sys
from tensorrt_llm.serve.log_config import configure_logging
logging.getLogger("uvicorn.access").addHandler(logging.StreamHandler(sys.stdout))  # a leftover
logging.getLogger("uvicorn").propagate = False
configure_logging(sys.argv[1])
for name in ("tensorrt_llm.serve.openai_server", "uvicorn.error", "uvicorn.access"):
    logging.getLogger(name).debug("debug line")
    logging.getLogger(name).info("info line")
    logging.getLogger(name).warning("warning line")
"""


@pytest.mark.parametrize("level", ["info", "warning"])
def test_log_level_and_format(level: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LOGGING_PROBE, level], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # leftover handlers removed
    lines = done.stderr.strip().splitlines()
    shown = ["info line", "warning line"] if level == "info" else ["warning line"]
    assert len(lines) == 3 * len(shown)
    for line in lines:
        assert _LINE.match(line), line
        assert line.split(": ", 1)[1] in shown
    assert LOG_FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s"


def test_served_command_logs_one_format(tmp_path: Path) -> None:
    """The real command, upstream's spelling: `serve --demo --extra_llm_api_options`."""
    config = tmp_path / "config.yaml"
    config.write_text("max_batch_size: 3\nkv_cache_config: {tokens_per_block: 16}\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "tensorrt_llm.commands.serve", "serve", "--demo"]
    cmd += ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--log_level", "info"]
    cmd += ["--extra_llm_api_options", str(config), "--backend", "pytorch", "--tp_size", "1"]
    log = tmp_path / "stderr.log"
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.3)
            model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
            assert httpx.get(f"{base}/v1/models/{model}", timeout=5).status_code == 200
            assert httpx.get(base + "/version", timeout=5).status_code == 200
            body = {"model": model, "messages": user("hi"), "max_tokens": 0}
            bad = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
            assert bad.status_code == 400
            metrics = httpx.get(base + "/metrics", timeout=5).text
        finally:
            proc.terminate()
            proc.wait(60)
    # The YAML reached the LLM: three seq slots.
    assert re.search(r"^trtllm_seq_slots_total\S* 3(\.0)?$", metrics, re.M), metrics[:2000]
    text = log.read_text()
    logged = [line for line in text.splitlines() if _LINE.match(line)]
    access = [line for line in logged if " INFO uvicorn.access: " in line]
    assert any('"GET /version HTTP/1.1" 200' in line for line in access), text[-3000:]
    assert any(" INFO uvicorn.error: Uvicorn running on" in line for line in logged)
    reason = bad.json()["error"]["message"]
    assert any(
        line.endswith(f"POST /v1/chat/completions 400: {reason}") and " INFO " in line
        for line in logged
    )
    # Nothing in uvicorn's own format ("INFO:     ..."), and no traceback.
    assert not re.search(r"^(INFO|WARNING|ERROR):\s", text, re.M), text[-3000:]
    assert "Traceback" not in text
