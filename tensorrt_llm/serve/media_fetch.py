"""Fetch http(s) media for a request without letting the request steer the server's network.

- Off unless MediaConfig.allow_remote_media or allowed_media_domains is set.
- Each hop's host is resolved once (the resolver runs off the event loop) and every address it
  gives is checked (media_address.address_refusal) unless allow_private_media_addresses. The
  connection then goes to that checked address: the URL carries the IP, the Host header the
  name, and for https the `sni_hostname` request extension the name too. httpcore passes
  that extension as `server_hostname` to the TLS handshake (ssl `wrap_bio`), so SNI and the
  certificate's host name check still use the real name. No second DNS lookup can rebind it.
- Redirects are followed here, never by the client, each hop checked again, at most 3.
- One deadline covers resolving, every hop and the whole body, so a server that trickles a
  byte every few seconds cannot hold a request past fetch_timeout_s.
- Client-facing errors say "media fetch failed: <category>" and nothing of the network error
  itself, so the server is no oracle for which internal ports are open; details go to the log.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass

import httpx

from .media_address import IPAddress, address_refusal, host_matches_domains, parse_ip_literal
from .media_config import MediaConfig, MediaError

logger = logging.getLogger(__name__)

MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def make_media_http_client(
    config: MediaConfig | None = None, verify: ssl.SSLContext | bool = True
) -> httpx.AsyncClient:
    """The httpx client the server holds for media fetches (verify: TLS trust, as httpx's).

    follow_redirects=False: fetch_remote checks each hop itself. trust_env=False: no proxy or
    netrc from the environment (a proxy would connect to the name itself, undoing the check).
    No keep-alive: pooled connections are keyed by the IP, and one opened for host A (its SNI
    and certificate) must not carry a later request for host B on the same address.
    """
    timeout = (config or MediaConfig()).fetch_timeout_s
    return httpx.AsyncClient(
        follow_redirects=False,
        trust_env=False,
        verify=verify,
        timeout=httpx.Timeout(timeout),
        limits=httpx.Limits(max_keepalive_connections=0),
        headers={"Accept-Encoding": "identity", "User-Agent": "trtllm-serve"},
    )


def fetch_failed(category: str, param: str | None, code: str = "media_fetch_failed") -> MediaError:
    return MediaError(f"media fetch failed: {category}", param, code)


@dataclass(frozen=True)
class _Hop:
    url: httpx.URL  # the URL with the checked IP as its host
    host_header: str  # the name (and port) the client asked for
    sni: str | None  # the name for TLS (https to a name); None for plain http or an IP


def parse_fetch_url(url: str | httpx.URL, param: str | None) -> httpx.URL:
    """An http(s) URL with a host and a valid port, else MediaError("... invalid URL")."""
    try:
        parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError, TypeError, UnicodeError):
        raise fetch_failed("invalid URL", param, "invalid_media_url") from None
    if parsed.scheme not in _DEFAULT_PORTS:
        raise fetch_failed("invalid URL (only http and https)", param, "invalid_media_url")
    if not parsed.raw_host:
        raise fetch_failed("invalid URL (no host)", param, "invalid_media_url")
    if port is not None and not 1 <= port <= 65535:
        raise fetch_failed("invalid URL (port out of range)", param, "invalid_media_url")
    if parsed.userinfo:
        raise fetch_failed("invalid URL (credentials are not allowed)", param, "invalid_media_url")
    return parsed


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    """Every address of `host`; an IP literal (in any spelling) without asking DNS."""
    literal = parse_ip_literal(host)
    if literal is not None:
        return [literal]
    # NOTE: loop.getaddrinfo runs the blocking resolver in the default executor.
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


async def _check_hop(url: httpx.URL, config: MediaConfig, param: str | None) -> _Hop:
    host = url.raw_host.decode("ascii")
    if config.allowed_media_domains and not host_matches_domains(
        host, config.allowed_media_domains
    ):
        logger.info("media fetch refused: host %r is not in allowed_media_domains", host)
        raise fetch_failed("domain not allowed", param)
    port = url.port or _DEFAULT_PORTS[url.scheme]
    try:
        addresses = await resolve_host(host, port)
    except (OSError, UnicodeError, ValueError) as exc:
        logger.info("media fetch: resolving %r failed: %s", host, exc)
        raise fetch_failed("connection failed", param) from None
    if not addresses:
        raise fetch_failed("connection failed", param)
    if not config.allow_private_media_addresses:
        for address in addresses:
            reason = address_refusal(address)
            if reason is not None:
                logger.info("media fetch refused: %r resolves to %s (%s)", host, address, reason)
                raise fetch_failed("address not allowed", param)
    address = addresses[0]
    ip_host = str(address).split("%", 1)[0]
    name_is_ip = parse_ip_literal(host) is not None
    sni = host if url.scheme == "https" and not name_is_ip else None
    return _Hop(url.copy_with(host=ip_host), url.netloc.decode("ascii"), sni)


async def _send(
    client: httpx.AsyncClient, hop: _Hop, config: MediaConfig, param: str | None
) -> httpx.Response:
    extensions = {"sni_hostname": hop.sni} if hop.sni else None
    request = client.build_request(
        "GET",
        hop.url,
        headers={"Host": hop.host_header, "Accept-Encoding": "identity"},
        extensions=extensions,
        timeout=config.fetch_timeout_s,
    )
    try:
        return await client.send(request, stream=True, follow_redirects=False)
    except httpx.TimeoutException:
        raise fetch_failed("timed out", param) from None
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:
        logger.info("media fetch: %s failed: %s: %s", hop.host_header, type(exc).__name__, exc)
        raise fetch_failed("connection failed", param) from None


async def _read_body(response: httpx.Response, config: MediaConfig, param: str | None) -> bytes:
    cap = config.max_media_bytes
    too_large = fetch_failed(f"too large (over the {cap}-byte media cap)", param, "media_too_large")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise too_large
    chunks, total = [], 0
    try:
        async for chunk in response.aiter_bytes():
            total += len(chunk)
            if total > cap:
                raise too_large
            chunks.append(chunk)
    except httpx.TimeoutException:
        raise fetch_failed("timed out", param) from None
    except (httpx.HTTPError, OSError) as exc:
        logger.info("media fetch: reading the body failed: %s: %s", type(exc).__name__, exc)
        raise fetch_failed("connection failed", param) from None
    return b"".join(chunks)


async def _follow(
    url: str, config: MediaConfig, client: httpx.AsyncClient, param: str | None
) -> tuple[bytes, str]:
    current = parse_fetch_url(url, param)
    for _ in range(MAX_REDIRECTS + 1):
        hop = await _check_hop(current, config, param)
        response = await _send(client, hop, config, param)
        try:
            status = response.status_code
            if status in _REDIRECT_STATUSES:
                location = response.headers.get("location")
                if not location:
                    raise fetch_failed(f"HTTP status {status} without a Location", param)
                try:
                    # NOTE: join against the URL as the client named it, not the IP form.
                    joined = current.join(location)
                except (httpx.InvalidURL, ValueError, UnicodeError):
                    raise fetch_failed("invalid redirect URL", param, "invalid_media_url") from None
                current = parse_fetch_url(joined, param)
                continue
            if status != 200:
                raise fetch_failed(f"HTTP status {status}", param)
            mime = response.headers.get("content-type", "").split(";")[0].strip().lower()
            return await _read_body(response, config, param), mime
        finally:
            await response.aclose()
    raise fetch_failed(f"too many redirects (more than {MAX_REDIRECTS})", param)


async def fetch_remote(
    url: str, config: MediaConfig, client: httpx.AsyncClient, param: str | None = None
) -> tuple[bytes, str]:
    """(body, declared MIME type) of an http(s) URL under the config's rules; MediaError else."""
    if not config.remote_media_enabled:
        raise fetch_failed(
            "remote media disabled (the server was started without --allow_remote_media or "
            "--allowed_media_domains)",
            param,
        )
    try:
        async with asyncio.timeout(config.fetch_timeout_s):
            return await _follow(url, config, client, param)
    except TimeoutError:
        raise fetch_failed(f"timed out (after {config.fetch_timeout_s} s)", param) from None
