"""A minimal asyncio HTTP/1.1 client for one streamed OpenAI request: POST, then SSE events.

Why not httpx: at c=128 the server streams about ten thousand events a second into one
benchmark event loop, and every microsecond of client overhead per event lands in the measured
ITL. This client reads the chunked body with `StreamReader` and decodes each event with the
stdlib `json` (no model classes), stamping arrival times as the bytes come in.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


class ServedRequestError(RuntimeError):
    """The server refused a request (non-200) or ended its stream with an error event."""


@dataclass
class StreamResult:
    start: float  # before the connection is opened and the body (data URLs included) is sent
    first_token: float | None  # arrival of the first non-empty content delta
    last_token: float | None  # arrival of the last non-empty content delta
    end: float  # arrival of [DONE] (or the end of the body)
    prompt_tokens: int  # from the final usage chunk; -1 when the server sent none
    completion_tokens: int
    content_chunks: int
    # usage.prompt_tokens_details.cached_tokens (prefix-cache hits); 0 when the server sent none.
    cached_tokens: int = 0
    text: str = ""  # the streamed content, with keep_text only (multi-turn history)
    # The client closed the stream after `stop_after` content chunks (no usage chunk then).
    stopped_early: bool = False


async def _read_headers(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ServedRequestError(f"not an HTTP response: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return int(parts[1]), headers
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()


async def _body_pieces(
    reader: asyncio.StreamReader, headers: dict[str, str]
) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked, by content-length, or until EOF."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after each chunk
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while piece := await reader.read(65536):
            yield piece


def _event_data(event: bytes) -> bytes | None:
    """The payload of an SSE event's data line(s); None for comments and keep-alives."""
    data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


class _StreamState:
    """What one stream's events say, with arrival times."""

    def __init__(self, start: float, keep_text: bool = False) -> None:
        self.result = StreamResult(start, None, None, start, -1, 0, 0)
        self.done = False
        self._pieces: list[str] | None = [] if keep_text else None

    def on_event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            self.done = True
            self.result.end = now
            return
        obj = json.loads(data)
        if "error" in obj:
            raise ServedRequestError(f"stream ended with an error: {obj['error']}")
        for choice in obj.get("choices") or ():
            if content := (choice.get("delta") or {}).get("content"):
                if self._pieces is not None:
                    self._pieces.append(content)
                res = self.result
                if res.first_token is None:
                    res.first_token = now
                res.last_token = now
                res.content_chunks += 1
        usage = obj.get("usage")
        if usage:
            self.result.prompt_tokens = int(usage["prompt_tokens"])
            self.result.completion_tokens = int(usage["completion_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            self.result.cached_tokens = int(details.get("cached_tokens") or 0)

    def finish_text(self) -> None:
        if self._pieces is not None:
            self.result.text = "".join(self._pieces)


def _request_head(host: str, port: int, path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")


async def post_stream(
    host: str,
    port: int,
    path: str,
    body: bytes,
    keep_text: bool = False,
    stop_after: int | None = None,
) -> StreamResult:
    """POST `body` (a streaming chat request) and time its SSE events.

    keep_text: gather the streamed content into `text`. stop_after: close the connection once
    that many content chunks arrived (the server aborts a request whose client is gone).
    """
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        writer.write(_request_head(host, port, path, len(body)))
        writer.write(body)
        await writer.drain()
        status, headers = await _read_headers(reader)
        if status != 200:
            text = b"".join([p async for p in _body_pieces(reader, headers)])
            raise ServedRequestError(f"HTTP {status}: {text[:2000].decode(errors='replace')}")
        state = _StreamState(start, keep_text)
        buf = b""
        async for piece in _body_pieces(reader, headers):
            now = time.perf_counter()
            buf += piece
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n")
            while (cut := buf.find(b"\n\n")) >= 0:
                data = _event_data(buf[:cut])
                buf = buf[cut + 2 :]
                if data is not None:
                    state.on_event(data, now)
                if stop_after is not None and state.result.content_chunks >= stop_after:
                    state.result.end = now
                    state.result.stopped_early = True
                    state.finish_text()
                    return state.result
        state.finish_text()
        if not state.done:
            state.result.end = time.perf_counter()
            raise ServedRequestError("the stream ended before [DONE]")
        return state.result
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass  # the server closed first; nothing left to flush


def get_body(host: str, port: int, path: str, timeout: float = 10.0) -> bytes | None:
    """A blocking GET for the control endpoints (/health, /v1/models, /metrics); None on a
    non-200."""
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return body if resp.status == 200 else None
    finally:
        conn.close()


def get_json(host: str, port: int, path: str, timeout: float = 10.0) -> Any:
    """`get_body` decoded as JSON; None on a non-200."""
    body = get_body(host, port, path, timeout)
    if body is None:
        return None
    return json.loads(body) if body else {}
