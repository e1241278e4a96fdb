"""Which hosts and addresses the server may fetch media from (pure functions, no network).

An address is public only if it is globally routable and none of loopback, private, link-local
(169.254.0.0/16 holds cloud metadata services), multicast, reserved, unspecified or site-local.
IPv6 forms that carry an IPv4 address (IPv4-mapped ::ffff:a.b.c.d, IPv4-compatible ::a.b.c.d,
NAT64 64:ff9b::/96, 6to4 2002::/16, Teredo) are judged by the IPv4 address inside as well.

Host text is judged after the resolver has turned it into addresses, so odd spellings of
127.0.0.1 (`2130706433`, `0x7f000001`, `127.1`, `0177.0.0.1`) end up as the address they mean;
`parse_ip_literal` reads those spellings the way inet_aton does, so such hosts never reach DNS.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def _inet_aton_part(text: str) -> int | None:
    if not text:
        return None
    try:
        if text[:2].lower() == "0x":
            return int(text[2:], 16) if text[2:] else 0
        if len(text) > 1 and text[0] == "0":
            return int(text[1:], 8)
        return int(text, 10) if text.isdigit() else None
    except ValueError:
        return None


def _parse_ipv4_loose(host: str) -> ipaddress.IPv4Address | None:
    """IPv4 in every spelling inet_aton accepts: a, a.b, a.b.c, a.b.c.d; decimal, 0x, 0 octal."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or not all(p.isascii() for p in parts):
        return None
    values = [_inet_aton_part(p) for p in parts]
    if any(v is None for v in values):
        return None
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (5 - len(values))):  # type: ignore[operator]
        return None
    number = last
    for index, value in enumerate(head):
        number |= value << (8 * (3 - index))  # type: ignore[operator]
    return ipaddress.IPv4Address(number)


def parse_ip_literal(host: str) -> IPAddress | None:
    """The address a URL host spells directly ([v6], any inet_aton v4 form), else None."""
    text = unquote(host).strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if ":" in text:
        try:
            return ipaddress.IPv6Address(text)  # accepts a %scope suffix
        except ValueError:
            return None
    return _parse_ipv4_loose(text.rstrip(".")) if text else None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    found = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    if address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 1):
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


def _is_public_one(address: IPAddress) -> bool:
    flags = (
        address.is_loopback,
        address.is_private,
        address.is_link_local,
        address.is_multicast,
        address.is_reserved,
        address.is_unspecified,
        getattr(address, "is_site_local", False),
    )
    return address.is_global and not any(flags)


def address_refusal(address: IPAddress) -> str | None:
    """Why `address` may not be fetched from without allow_private_media_addresses, else None."""
    candidates: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        # NOTE: drop a %scope: the scope names an interface, the address decides the range.
        if address.scope_id is not None:
            address = ipaddress.IPv6Address(str(address).split("%", 1)[0])
            candidates = [address]
        embedded = _embedded_ipv4(address)
        if address.ipv4_mapped is not None or address in _IPV4_COMPATIBLE:
            # These forms only carry an IPv4 address (::/8 itself counts as reserved), so the
            # IPv4 address alone decides; ::ffff:8.8.8.8 is as public as 8.8.8.8.
            candidates = embedded or candidates
        else:
            candidates += embedded
    for candidate in candidates:
        if not _is_public_one(candidate):
            return _category(candidate)
    return None


def _category(address: IPAddress) -> str:
    for name in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):
        if getattr(address, f"is_{name}"):
            return name.replace("_", "-")
    return "non-public"


def host_matches_domains(host: str, domains: tuple[str, ...]) -> bool:
    """Whether a URL host is on the allowlist: exact names, and "*.x" for subdomains of x."""
    name = host.lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    for entry in domains:
        if entry.startswith("*."):
            if name.endswith(entry[1:]) and len(name) > len(entry) - 1:
                return True
        elif name == entry:
            return True
    return False
