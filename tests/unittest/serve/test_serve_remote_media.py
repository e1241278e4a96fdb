"""The server's remote-media flags reach the fetcher: off by default, on with the flags.

Only a loopback HTTP server started here is ever contacted."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import httpx
import pytest
from serve_helpers import ServeHandle, image_part, png_bytes, start_server, user

PNG = png_bytes(size=(40, 40))


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("content-type", "image/png")
        self.send_header("content-length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    finally:
        server.shutdown()


def _ask(handle: ServeHandle, url: str) -> httpx.Response:
    body = {"model": handle.model, "messages": user(image_part(url), "What is it?")}
    body["max_tokens"] = 2
    return httpx.post(handle.base_url + "/v1/chat/completions", json=body, timeout=60)


def test_remote_media_is_off_by_default(served: ServeHandle, image_url: str) -> None:
    r = _ask(served, image_url)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "media_fetch_failed" and "remote media" in error["message"]


@pytest.mark.parametrize(
    "flags,status",
    [
        (["--allow_remote_media"], 400),  # on, but loopback stays refused
        (["--allowed_media_domains", "127.0.0.1"], 400),
        (["--allow_remote_media", "--allow_private_media_addresses"], 200),
        (["--allowed_media_domains", "127.0.0.1", "--allow_private_media_addresses"], 200),
        (["--allowed_media_domains", "other.example", "--allow_private_media_addresses"], 400),
    ],
)
def test_remote_media_flags(
    served: ServeHandle, image_url: str, flags: list[str], status: int
) -> None:
    handle = start_server(["--demo", *flags], llm=served.llm)
    try:
        r = _ask(handle, image_url)
    finally:
        handle.stop()
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["code"] == "media_fetch_failed"
