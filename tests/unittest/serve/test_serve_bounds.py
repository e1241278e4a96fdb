"""Bounded work per request and per connection: body size and read deadline, header deadline,
prompts and sequences per request, default media limits, submission outside any shared lock,
and a client that leaves mid-body (a cancellation, not a 500)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import ServeHandle, data_url, image_part, metric, png_bytes, start_server, user

from tensorrt_llm.serve import build_app
from tensorrt_llm.serve.llm_client import LLMClient


@pytest.fixture(scope="module")
def tight(served: ServeHandle) -> Iterator[ServeHandle]:
    """A second server on the same LLM with small bounds."""
    handle = start_server(
        [
            "--demo",
            "--max_request_body_bytes",
            "4000",
            "--body_read_timeout",
            "1",
            "--header_read_timeout",
            "1",
            "--max_prompts_per_request",
            "4",
            "--max_sequences_per_request",
            "8",
        ],
        llm=served.llm,
    )
    try:
        yield handle
    finally:
        handle.stop()


def _port(handle: ServeHandle) -> int:
    return int(handle.base_url.rsplit(":", 1)[1])


def _raw(handle: ServeHandle, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _port(handle)), timeout=10)
    sock.sendall(head)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _chat(handle: ServeHandle, text: str = "hi") -> dict[str, Any]:
    return {"model": handle.model, "messages": user(text), "max_tokens": 2}


def test_body_over_the_cap_gets_413_before_it_is_read(tight: ServeHandle) -> None:
    body = json.dumps(_chat(tight, "x" * 5000))
    r = httpx.post(tight.base_url + "/v1/chat/completions", content=body, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it is read
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(tight.base_url + "/v1/chat/completions", content=chunks(), timeout=10)
    assert r.status_code == 413
    ok = httpx.post(tight.base_url + "/v1/chat/completions", json=_chat(tight), timeout=60)
    assert ok.status_code == 200


def test_trickled_body_gets_408_at_the_total_deadline(tight: ServeHandle) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 200\r\n\r\n"
    )
    sock = _raw(tight, head)
    start = time.monotonic()
    status = b""
    for _ in range(20):  # one byte every 0.3 s: each read is quick, the whole body is not
        try:
            sock.sendall(b" ")
        except OSError:
            break
        sock.settimeout(0.3)
        try:
            status = sock.recv(4096)
        except TimeoutError:
            continue
        break
    sock.close()
    assert status.startswith(b"HTTP/1.1 408"), status[:80]
    assert time.monotonic() - start < 4.0


def test_slow_headers_are_cut_off(tight: ServeHandle) -> None:
    sock = _raw(tight, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    start = time.monotonic()
    closed_after = None
    for _ in range(30):
        try:
            sock.sendall(b"x")
        except OSError:
            closed_after = time.monotonic() - start
            break
        sock.settimeout(0.3)
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        assert data == b"" or data.startswith(b"HTTP/1.1 408"), data[:80]
        closed_after = time.monotonic() - start
        break
    sock.close()
    assert closed_after is not None and closed_after < 4.0


def test_client_leaving_mid_body_is_a_cancellation(
    tight: ServeHandle, caplog: pytest.LogCaptureFixture
) -> None:
    before = tight.metrics()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 3000\r\n\r\n{"model": '
    )
    with caplog.at_level(logging.ERROR):
        sock = _raw(tight, head)
        time.sleep(0.2)
        sock.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = tight.metrics()
            cancelled = metric(after, "trtllm_http_requests_total", status="499")
            try:
                was = metric(before, "trtllm_http_requests_total", status="499")
            except AssertionError:
                was = 0.0
            if cancelled > was:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the disconnect was not counted as status 499")
    assert not any("unhandled" in r.getMessage() for r in caplog.records)
    with pytest.raises(AssertionError):  # never exported: nothing became a 500
        metric(after, "trtllm_http_requests_total", status="500")


@pytest.mark.parametrize(
    "num_prompts,n,code",
    [(5, 1, "too_many_prompts"), (3, 3, "too_many_sequences")],
)
def test_prompts_and_sequences_per_request_are_capped(
    tight: ServeHandle, num_prompts: int, n: int, code: str
) -> None:
    body = {"model": tight.model, "prompt": ["hello"] * num_prompts, "n": n, "max_tokens": 1}
    r = httpx.post(tight.base_url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == code
    body.update(prompt=["hello"] * 4, n=2)  # exactly at both caps
    r = httpx.post(tight.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


class _NoLimitsLLM:
    """An LLM stand-in without media limits: the request is refused before it is used."""

    tokenizer = None
    max_seq_len = 64

    def generate_async(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the request should have been refused before submission")

    def shutdown(self) -> None:
        pass


def test_default_media_limits_without_the_flag() -> None:
    app = build_app(_NoLimitsLLM(), Namespace(served_model_name="m"))
    assert app.state.server.mm_limits == {"image": 16, "video": 2}
    url = data_url(png_bytes(size=(8, 8)))
    body = {"model": "m", "messages": user(*[image_part(url)] * 17, "hi"), "max_tokens": 1}

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/chat/completions", json=body)

    r = asyncio.run(post())
    assert r.status_code == 400 and r.json()["error"]["code"] == "mm_limit_exceeded"


class _SlowFrontEnd:
    """generate_async takes 1 s for the prompt 'slow' (as tokenizing a huge prompt would)."""

    tokenizer = None

    def __init__(self) -> None:
        self.active = 0
        self.most_active = 0
        self._lock = threading.Lock()

    def generate_async(self, prompt: Any, **kwargs: Any) -> str:
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        time.sleep(1.0 if prompt == "slow" else 0.0)
        with self._lock:
            self.active -= 1
        return prompt

    def shutdown(self) -> None:
        pass


def test_one_slow_submission_does_not_hold_up_others() -> None:
    llm = _SlowFrontEnd()
    client = LLMClient(llm, model_name="m")

    async def run() -> float:
        slow = asyncio.ensure_future(client.submit("slow", None, streaming=False))
        await asyncio.sleep(0.1)
        start = time.monotonic()
        assert await client.submit("fast", None, streaming=False) == "fast"
        elapsed = time.monotonic() - start
        assert await slow == "slow"
        return elapsed

    assert asyncio.run(run()) < 0.5
    assert llm.most_active == 2
