"""Shutdown with requests in flight: what can finish within the grace period finishes; the rest
gets a 503 JSON body (non-streaming) or an error event and [DONE] (streams); a request that
arrives while draining gets 503 `shutting_down`; the engine is left with nothing running."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import ServeHandle, spawn_server, start_server, user

from tensorrt_llm import LLM
from tensorrt_llm.commands.serve import llm_kwargs, parse_args, resolve_model_dir

GRACE_S = 2.0
# Seconds of demo decode on a 2-core CPU (~5 ms a token): never done within GRACE_S. (480
# tokens once were, on a quiet machine.)
LONG_SEQ_LEN = 4096
LONG_TOKENS = 4000


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


@pytest.fixture(scope="module")
def long_llm() -> Iterator[LLM]:
    """The demo LLM with room for LONG_TOKENS (the shared one stops at 512)."""
    args = parse_args(["--demo", "--max_seq_len", str(LONG_SEQ_LEN)])
    llm = LLM(model=resolve_model_dir(args), **llm_kwargs(args))
    yield llm
    llm.shutdown()


def _wait_idle(llm: LLM, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.get_stats()
        idle = stats.num_running == stats.num_waiting == 0
        if (idle and stats.num_free_seq_slots == stats.num_total_seq_slots) or (
            time.monotonic() > deadline
        ):
            return stats
        time.sleep(0.05)


def test_shutdown_finishes_what_it_can_and_answers_the_rest(long_llm: LLM) -> None:
    handle = start_server(
        ["--demo", "--timeout_graceful_shutdown", str(GRACE_S)],
        graceful_s=GRACE_S,
        llm=long_llm,
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
    # The LLM (it outlives the server) is left with nothing running.
    stats = _wait_idle(long_llm)
    assert stats.num_running == stats.num_waiting == 0, stats
    assert stats.num_free_seq_slots == stats.num_total_seq_slots, stats


def test_sigint_with_requests_in_flight_answers_every_client() -> None:
    """The real command: SIGINT while 8 long requests run; every client gets a clear end."""
    proc, base, model = spawn_server(
        ["--max_seq_len", str(LONG_SEQ_LEN), "--timeout_graceful_shutdown", "1"]
    )
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
