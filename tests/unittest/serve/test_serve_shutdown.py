"""Shutdown with requests in flight: what can finish within the grace period finishes; the rest
gets a 503 JSON body (non-streaming) or an error event and [DONE] (streams); a request that
arrives while draining gets 503 `shutting_down`; the engine is left with nothing running."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
from serve_helpers import ServeHandle, spawn_server, start_server, user, wait_until_idle

GRACE_S = 2.0
LONG_TOKENS = 480  # far more than the demo model makes in GRACE_S on a CPU


def _body(handle: ServeHandle, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": handle.model,
        "messages": user("tell me a long story"),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def _post(handle: ServeHandle, body: dict[str, Any], out: dict[str, Any], key: str) -> None:
    try:
        with httpx.stream(
            "POST", handle.base_url + "/v1/chat/completions", json=body, timeout=60
        ) as r:
            out[key] = (r.status_code, r.headers.get("content-type", ""), r.read().decode())
    except httpx.HTTPError as exc:
        out[key] = ("transport error", type(exc).__name__, str(exc))


def test_shutdown_finishes_what_it_can_and_answers_the_rest(served: ServeHandle) -> None:
    handle = start_server(
        ["--demo", "--max_seq_len", "512", "--timeout_graceful_shutdown", str(GRACE_S)],
        graceful_s=GRACE_S,
        llm=served.llm,
    )
    out: dict[str, Any] = {}
    jobs = {
        "short": _body(handle, 2, stream=False),
        "short_stream": _body(handle, 2, stream=True),
        "long": _body(handle, LONG_TOKENS, stream=False),
        "long_stream": _body(handle, LONG_TOKENS, stream=True),
    }
    threads = [
        threading.Thread(target=_post, args=(handle, body, out, key)) for key, body in jobs.items()
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while handle.llm.get_stats().num_running < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    stopper = threading.Thread(target=handle.stop)
    stopper.start()
    time.sleep(0.3)
    late: dict[str, Any] = {}
    _post(handle, _body(handle, 2, stream=False), late, "late")
    stopper.join(60)
    for t in threads:
        t.join(60)

    assert late["late"][0] == 503 and json.loads(late["late"][2])["error"]["code"] == (
        "shutting_down"
    )
    status, ctype, text = out["short"]
    assert status == 200, out["short"]
    assert out["short_stream"][0] == 200 and out["short_stream"][2].rstrip().endswith("[DONE]")
    status, ctype, text = out["long"]
    assert status == 503 and ctype.startswith("application/json"), out["long"]
    assert json.loads(text)["error"]["code"] == "shutting_down"
    status, _, text = out["long_stream"]
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", text[-300:]
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    # The LLM (shared with the other tests) is left with nothing running.
    samples = wait_until_idle(served)
    assert samples, "metrics unavailable"
    assert served.llm.get_stats().num_running == 0


def test_sigint_with_requests_in_flight_answers_every_client() -> None:
    """The real command: SIGINT while 8 long requests run; every client gets a clear end."""
    proc, base, model = spawn_server(["--max_seq_len", "512", "--timeout_graceful_shutdown", "1"])
    try:
        handle = ServeHandle(base, model, None, None, None)  # type: ignore[arg-type]
        out: dict[str, Any] = {}
        threads = [
            threading.Thread(
                target=_post, args=(handle, _body(handle, LONG_TOKENS, stream=i % 2 == 1), out, i)
            )
            for i in range(8)
        ]
        for t in threads:
            t.start()
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        # A graceful Ctrl-C is a clean exit (no KeyboardInterrupt traceback either).
        assert proc.wait(60) == 0
        assert b"KeyboardInterrupt" not in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for i in range(8):
        status, _, text = out[i]
        if i % 2 == 0:
            assert status == 503 and json.loads(text)["error"]["code"] == "shutting_down", out[i]
        else:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert status == 200 and events[-1] == "[DONE]", text[-300:]
            assert json.loads(events[-2])["error"]["code"] == "shutting_down"
