"""The served benchmark's HTTP/SSE client against canned responses from a loopback server.

The server here is a bare asyncio socket server the test starts on 127.0.0.1, so the bytes on
the wire (chunk boundaries inside events, CRLF line ends, error events) are exactly as written.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from tensorrt_llm.bench.sse_client import ServedRequestError, StreamResult, post_stream


def _event(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _delta(content: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}


def _chunked(pieces: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return body + b"0\r\n\r\n"


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def _serve_once(
    response: Callable[[bytes], list[bytes]], client: Callable[[int], Awaitable[StreamResult]]
) -> tuple[StreamResult, bytes]:
    """Answer one request with `response(request_bytes)`'s writes (each flushed alone)."""
    seen = bytearray()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        seen.extend(head + await reader.readexactly(length))
        for part in response(bytes(seen)):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)  # separate arrivals, so the timestamps differ
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        result = await client(port)
    return result, bytes(seen)


def _run(response: Callable[[bytes], list[bytes]], body: bytes = b'{"x": 1}') -> StreamResult:
    async def client(port: int) -> StreamResult:
        return await post_stream("127.0.0.1", port, "/v1/chat/completions", body)

    return asyncio.run(_serve_once(response, client))[0]


def test_stream_timings_usage_and_split_events() -> None:
    role = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    events = role + _event(_delta("a")) + _event(_delta("bc")) + _event(_delta("d"))
    usage = _event({"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": 5}})
    done = _event(b"[DONE]")
    # Chunk boundaries fall inside events and inside the "data:" prefix; CRLF line ends.
    wire = (events + usage).replace(b"\n", b"\r\n") + done
    pieces = [wire[i : i + 23] for i in range(0, len(wire), 23)]  # events are longer than 23
    res = _run(lambda _: [_HEAD, *(_chunked([p])[:-5] for p in pieces), b"0\r\n\r\n"])
    assert res.prompt_tokens == 17 and res.completion_tokens == 5
    assert res.content_chunks == 3  # the role chunk's empty content is no token
    assert res.first_token is not None and res.last_token is not None
    assert res.start < res.first_token < res.last_token <= res.end


def test_request_carries_body_and_length() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "é" * 10}]}).encode()
    done = [_HEAD, _chunked([_event(b"[DONE]")])]

    async def client(port: int) -> StreamResult:
        return await post_stream("127.0.0.1", port, "/v1/chat/completions", body)

    _, seen = asyncio.run(_serve_once(lambda _: done, client))
    head, _, sent = seen.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert f"content-length: {len(body)}".encode() in head.lower()
    assert sent == body


def test_http_error_status_raises_with_body() -> None:
    err = b'{"error": {"message": "bad image", "type": "invalid_request_error"}}'
    head = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(err)
    with pytest.raises(ServedRequestError, match="HTTP 400.*bad image"):
        _run(lambda _: [head + err])


def test_error_event_and_truncated_stream_raise() -> None:
    error = _event({"error": {"message": "engine died", "code": 500}})
    with pytest.raises(ServedRequestError, match="engine died"):
        _run(lambda _: [_HEAD, _chunked([_event(_delta("a")), error])])
    with pytest.raises(ServedRequestError, match="before \\[DONE\\]"):
        _run(lambda _: [_HEAD, _chunked([_event(_delta("a"))])])


def test_text_cached_tokens_and_early_close() -> None:
    deltas = [_event(_delta(t)) for t in ("a", " b", " c", " d")]
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 6},
    }
    tail = [_event({"choices": [], "usage": usage}), _event(b"[DONE]")]
    wire = [_HEAD, *(_chunked([d])[:-5] for d in deltas + tail), b"0\r\n\r\n"]

    def run(**kwargs: object) -> StreamResult:
        async def client(port: int) -> StreamResult:
            return await post_stream("127.0.0.1", port, "/v1/chat/completions", b"{}", **kwargs)  # type: ignore[arg-type]

        return asyncio.run(_serve_once(lambda _: wire, client))[0]

    whole = run(keep_text=True)
    assert whole.text == "a b c d" and whole.cached_tokens == 6 and not whole.stopped_early
    assert run().text == ""  # text is kept only when asked for
    cut = run(keep_text=True, stop_after=2)
    assert cut.stopped_early and cut.content_chunks == 2 and cut.text == "a b"
    assert cut.prompt_tokens == -1 and cut.end == cut.last_token  # closed before the usage
