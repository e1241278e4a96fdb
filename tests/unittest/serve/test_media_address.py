"""Which media hosts and addresses the server may fetch from: pure functions, nothing connects."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorrt_llm.serve.media_address import (
    address_refusal,
    host_matches_domains,
    parse_ip_literal,
)
from tensorrt_llm.serve.media_config import MediaConfig, MediaError
from tensorrt_llm.serve.media_fetch import parse_fetch_url

# Spellings of 127.0.0.1 that URL parsers pass through and resolvers accept.
LOOPBACK_SPELLINGS = [
    "127.0.0.1",
    "2130706433",
    "0x7f000001",
    "0X7F000001",
    "127.1",
    "127.0.1",
    "0177.0.0.1",
    "0x7f.0.0.1",
    "0x7f.1",
    "017700000001",
    "127.0.0.1.",
    "[::ffff:127.0.0.1]",
    "::ffff:127.0.0.1",
    "[::ffff:7f00:1]",
    "[0:0:0:0:0:ffff:127.0.0.1]",
    "[::1]",
    "[0:0:0:0:0:0:0:1]",
    "[::127.0.0.1]",  # IPv4-compatible (deprecated) form
    "127.255.255.254",
]


@pytest.mark.parametrize("host", LOOPBACK_SPELLINGS)
def test_loopback_spellings_are_refused(host: str) -> None:
    address = parse_ip_literal(host)
    assert address is not None, host
    assert address_refusal(address) == "loopback", (host, address)


@pytest.mark.parametrize(
    "url",
    [
        "http://0x7f000001/a.png",
        "http://2130706433:8080/a.png",
        "http://127.1/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "https://[::1]:443/a.png",
    ],
)
def test_url_hosts_as_the_fetcher_sees_them(url: str) -> None:
    """The host text httpx hands on (what would be connected to) is read as loopback."""
    host = parse_fetch_url(url, "p").raw_host.decode("ascii")
    address = parse_ip_literal(host)
    assert address is not None and address_refusal(address) == "loopback"


@pytest.mark.parametrize(
    "address, reason",
    [
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("100.64.0.1", "non-public"),  # carrier-grade NAT
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("198.18.0.1", "private"),  # benchmarking
        ("::", "unspecified"),
        ("fe80::1", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("fc00::1", "private"),
        ("fec0::1", "non-public"),  # site-local
        ("ff02::1", "multicast"),
        ("::ffff:169.254.169.254", "link-local"),
        ("::ffff:10.0.0.1", "private"),
        ("64:ff9b::a9fe:a9fe", "reserved"),  # NAT64 (of 169.254.169.254)
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "private"),  # Teredo
    ],
)
def test_non_public_addresses_are_refused(address: str, reason: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "93.184.215.14", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8"]
)
def test_public_addresses_pass(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize("host", ["example.com", "127.0.0.1.nip.io", "08.0.0.1", "1.2.3.4.5", ""])
def test_names_are_not_ip_literals(host: str) -> None:
    assert parse_ip_literal(host) is None


_PART = st.integers(0, 255)


@st.composite
def _ipv4_spelling(draw: st.DrawFn) -> str:
    """A random address in one of inet_aton's spellings (1-4 parts, decimal/hex/octal)."""
    count = draw(st.integers(1, 4))
    values = [draw(_PART) for _ in range(count - 1)]
    values.append(draw(st.integers(0, (1 << (8 * (5 - count))) - 1)))
    styles = [draw(st.sampled_from(["dec", "hex", "oct"])) for _ in values]
    shown = {"dec": str, "hex": hex, "oct": lambda v: "0" + format(v, "o")}
    return ".".join(shown[style](v) for style, v in zip(styles, values, strict=True))


@settings(max_examples=300, deadline=None)
@given(_ipv4_spelling())
def test_ipv4_spellings_agree_with_inet_aton(text: str) -> None:
    """parse_ip_literal reads every spelling the way the C resolver does (inet_aton, no I/O)."""
    want = ipaddress.IPv4Address(socket.inet_aton(text))
    assert parse_ip_literal(text) == want


def test_domain_allowlist_matching() -> None:
    domains = MediaConfig(
        allowed_media_domains=["Media.Example.COM.", "*.cdn.test"]
    ).allowed_media_domains
    assert domains == ("media.example.com", "*.cdn.test")
    assert host_matches_domains("media.example.com", domains)
    assert host_matches_domains("MEDIA.example.com.", domains)
    assert host_matches_domains("a.b.cdn.test", domains)
    for host in (
        "example.com",
        "x.media.example.com",
        "cdn.test",
        "evilcdn.test",
        "cdn.test.evil.com",
        "media.example.com.evil.com",
    ):
        assert not host_matches_domains(host, domains), host


def test_config_turns_remote_on_and_validates_domains() -> None:
    assert not MediaConfig().remote_media_enabled
    assert MediaConfig(allow_remote_media=True).remote_media_enabled
    assert MediaConfig(allowed_media_domains=("a.test",)).remote_media_enabled
    assert not MediaConfig(allowed_media_domains=()).remote_media_enabled
    for bad in (["http://a.test"], ["a.test:80"], [""], ["*"], ["a.*.test"], [3]):
        with pytest.raises(ValueError, match="allowed_media_domains"):
            MediaConfig(allowed_media_domains=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a str"):
        MediaConfig(allowed_media_domains="a.test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_image_pixels"):
        MediaConfig(max_image_pixels=0)


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("http://127.0.0.1:99999/a.png", "port out of range"),
        ("http://h:0/a.png", "port out of range"),
        ("http://[::1/a.png", "invalid URL"),
        ("http:///a.png", "no host"),
        ("http://user:pw@h/a.png", "credentials"),
        ("ftp://h/a.png", "only http and https"),
        ("http://h:port/a.png", "invalid URL"),
    ],
)
def test_bad_fetch_urls(url: str, fragment: str) -> None:
    with pytest.raises(MediaError) as info:
        parse_fetch_url(url, "p")
    assert info.value.code == "invalid_media_url" and info.value.param == "p"
    assert str(info.value).startswith("media fetch failed: invalid URL") and fragment in str(
        info.value
    )
