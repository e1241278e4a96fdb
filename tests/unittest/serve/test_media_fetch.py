"""Remote media fetching end to end, against loopback HTTP(S) servers the tests start.

Nothing here connects anywhere but 127.0.0.0/8: names other tests need ("media.test", ...) are
mapped to loopback addresses by replacing media_fetch.resolve_host.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import png_bytes

from tensorrt_llm.serve import media_fetch
from tensorrt_llm.serve.media import MediaConfig, MediaError, load_image_url, make_media_http_client

PNG = png_bytes(size=(20, 10))


class _Handler(BaseHTTPRequestHandler):
    """Routes: /img.png, /hop/<n>/<final URL> (n redirects, then to the final URL), /trickle."""

    def log_message(self, *args: Any) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        self.server.seen.append((self.path, self.headers.get("Host")))  # type: ignore[attr-defined]
        if self.path == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif self.path.startswith("/hop/"):
            _, _, count, target = self.path.split("/", 3)
            left = int(count)
            location = f"/hop/{left - 1}/{target}" if left > 1 else target
            self._send(302, b"", {"Location": location})
        elif self.path == "/trickle":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "40")
            self.end_headers()
            try:
                for _ in range(40):  # one byte every 0.25 s: 10 s in all
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.25)
            except OSError:
                pass  # the client gave up, as it should
        else:
            self._send(404, b"missing", {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server:
    def __init__(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.httpd = ThreadingHTTPServer((host, 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.seen = []  # type: ignore[attr-defined]
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def seen(self) -> list[tuple[str, str | None]]:
        return self.httpd.seen  # type: ignore[attr-defined]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    yield srv
    srv.close()


@pytest.fixture
def server2() -> Iterator[_Server]:
    srv = _Server("127.0.0.2")  # all of 127.0.0.0/8 is loopback on Linux
    yield srv
    srv.close()


def _fake_dns(monkeypatch: pytest.MonkeyPatch, names: dict[str, str]) -> None:
    real = media_fetch.resolve_host

    async def resolve(host: str, port: int) -> list[Any]:
        if host in names:
            return [ipaddress.ip_address(names[host])]
        return await real(host, port)

    monkeypatch.setattr(media_fetch, "resolve_host", resolve)


def _allow_only(monkeypatch: pytest.MonkeyPatch, public: str) -> None:
    """Treat one loopback address as public, so a redirect from it to others can be tested."""
    real = media_fetch.address_refusal
    monkeypatch.setattr(
        media_fetch, "address_refusal", lambda a: None if str(a) == public else real(a)
    )


def _fetch(url: str, config: MediaConfig, verify: ssl.SSLContext | bool = True) -> Any:
    async def run() -> Any:
        async with make_media_http_client(config, verify=verify) as client:
            return await load_image_url(url, config, client, param="p")

    return asyncio.run(run())


def _error(url: str, config: MediaConfig, verify: ssl.SSLContext | bool = True) -> str:
    with pytest.raises(MediaError) as info:
        _fetch(url, config, verify)
    assert info.value.param == "p"
    return str(info.value)


PRIVATE_OK = MediaConfig(allow_remote_media=True, allow_private_media_addresses=True)


def test_remote_media_is_off_by_default(server: _Server) -> None:
    url = f"http://127.0.0.1:{server.port}/img.png"
    assert _error(url, MediaConfig()).startswith("media fetch failed: remote media disabled")
    assert server.seen == []


def test_loopback_is_refused_in_every_spelling(server: _Server) -> None:
    port = server.port
    config = MediaConfig(allow_remote_media=True)
    for host in (
        "127.0.0.1",
        "localhost",
        "0x7f000001",
        "2130706433",
        "127.1",
        "[::ffff:127.0.0.1]",
    ):
        assert _error(f"http://{host}:{port}/img.png", config) == (
            "media fetch failed: address not allowed"
        ), host
    assert server.seen == []  # refused before connecting
    image = _fetch(f"http://127.1:{port}/img.png", PRIVATE_OK)
    assert image.size == (20, 10)


def test_redirects_are_followed_and_rechecked(
    monkeypatch: pytest.MonkeyPatch, server: _Server, server2: _Server
) -> None:
    _allow_only(monkeypatch, "127.0.0.1")
    config = MediaConfig(allow_remote_media=True)
    base = f"http://127.0.0.1:{server.port}"
    assert _fetch(f"{base}/hop/3//img.png", config).size == (20, 10)  # 3 redirects: fine
    assert [path for path, _ in server.seen] == [
        "/hop/3//img.png",
        "/hop/2//img.png",
        "/hop/1//img.png",
        "/img.png",
    ]
    server.seen.clear()
    assert _error(f"{base}/hop/4//img.png", config) == (
        "media fetch failed: too many redirects (more than 3)"
    )
    assert len(server.seen) == 4  # the fifth request is never sent
    for target in (
        f"http://127.0.0.2:{server2.port}/img.png",
        f"http://0x7f000002:{server2.port}/img.png",
        f"http://[::ffff:127.0.0.2]:{server2.port}/img.png",
        "http://169.254.169.254/latest/meta-data",
    ):
        assert _error(f"{base}/hop/2/{target}", config) == (
            "media fetch failed: address not allowed"
        ), target
    assert server2.seen == []
    assert "invalid" in _error(f"{base}/hop/1/file:///etc/passwd", config)


def test_domain_allowlist(monkeypatch: pytest.MonkeyPatch, server: _Server) -> None:
    _fake_dns(monkeypatch, {"media.test": "127.0.0.1", "other.test": "127.0.0.1"})
    port = server.port
    # The allowlist alone turns fetching on; loopback needs allow_private as always.
    config = MediaConfig(allowed_media_domains=("media.test",), allow_private_media_addresses=True)
    assert _fetch(f"http://media.test:{port}/img.png", config).size == (20, 10)
    assert server.seen == [("/img.png", f"media.test:{port}")]  # Host: the name, not the IP
    server.seen.clear()
    for url in (
        f"http://other.test:{port}/img.png",
        f"http://127.0.0.1:{port}/img.png",
        f"http://media.test:{port}/hop/1/http://other.test:{port}/img.png",
    ):
        assert _error(url, config) == "media fetch failed: domain not allowed", url
    assert [path for path, _ in server.seen] == [f"/hop/1/http://other.test:{port}/img.png"]
    assert "address not allowed" in _error(
        f"http://media.test:{port}/img.png", MediaConfig(allowed_media_domains=("media.test",))
    )


def test_errors_do_not_tell_closed_ports_apart(server: _Server) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]  # bound, never listening: connection refused
    assert _error(f"http://127.0.0.1:{closed}/x.png", PRIVATE_OK) == (
        "media fetch failed: connection failed"
    )
    assert _error(f"http://127.0.0.1:{server.port}/nope", PRIVATE_OK) == (
        "media fetch failed: HTTP status 404"
    )


def test_total_deadline_against_a_trickling_server(server: _Server) -> None:
    """Every read comes within the timeout, but the whole fetch must end after fetch_timeout_s."""
    config = MediaConfig(
        allow_remote_media=True, allow_private_media_addresses=True, fetch_timeout_s=1.0
    )
    start = time.monotonic()
    message = _error(f"http://127.0.0.1:{server.port}/trickle", config)
    elapsed = time.monotonic() - start
    assert message.startswith("media fetch failed: timed out"), message
    assert elapsed < 2.5, elapsed


# ---------------------------------------------------------------- https: SNI and certificates


def _tls_pair(tmp_path: Path, name: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a self-signed certificate for `name`, and a client trusting it."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client_ctx = ssl.create_default_context(cadata=cert_pem.decode())
    return server_ctx, client_ctx


def test_https_uses_the_checked_ip_with_the_real_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The certificate names only media.test (no IP): the fetch succeeds only if SNI and the
    host name check use the name while the connection goes to the checked IP."""
    server_ctx, client_ctx = _tls_pair(tmp_path, "media.test")
    sni_seen: list[str | None] = []
    server_ctx.sni_callback = lambda sock, name, ctx: sni_seen.append(name)
    srv = _Server(tls=server_ctx)
    try:
        _fake_dns(monkeypatch, {"media.test": "127.0.0.1", "wrong.test": "127.0.0.1"})
        image = _fetch(f"https://media.test:{srv.port}/img.png", PRIVATE_OK, client_ctx)
        assert image.size == (20, 10)
        assert sni_seen == ["media.test"]
        assert srv.seen == [("/img.png", f"media.test:{srv.port}")]
        # A name the certificate does not cover fails the handshake (checked against the name).
        message = _error(f"https://wrong.test:{srv.port}/img.png", PRIVATE_OK, client_ctx)
        assert message == "media fetch failed: connection failed"
    finally:
        srv.close()
