"""Media settings of the server (`MediaConfig`) and the error every media problem raises."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..inputs.image_formats import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_VIDEO_PIXELS

DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_MEDIA_BYTES = 32 * 1024 * 1024


class MediaError(ValueError):
    """A media source that cannot be used; the server answers it with HTTP 400.

    param: the request field it came from; code: a stable machine-readable reason
    (invalid_media_url, unsupported_media_type, corrupt_media, media_too_large,
    media_fetch_failed, local_media_disabled, local_path_not_allowed, media_not_found).
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_media") -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in a preprocess worker, it crosses back to the server pickled.
        return type(self), (str(self), self.param, self.code)


def _normalise_domain(entry: object) -> str:
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"allowed_media_domains entries must be non-empty host names: {entry!r}")
    host = entry.strip().lower().rstrip(".")
    wildcard = host.startswith("*.")
    bare = host[2:] if wildcard else host
    if not bare or "*" in bare or "/" in bare or ":" in bare.strip("[]"):
        raise ValueError(
            f"allowed_media_domains entry {entry!r} must be a host name such as example.com or "
            f"*.example.com (no scheme, port or path)"
        )
    try:
        bare = bare.encode("idna").decode("ascii")  # compare in the form URLs carry on the wire
    except UnicodeError:
        raise ValueError(
            f"allowed_media_domains entry {entry!r} is not a valid host name"
        ) from None
    return "*." + bare if wildcard else bare


@dataclass(frozen=True)
class MediaConfig:
    """Where media may come from, and how much of it one item may be.

    allowed_local_media_path: local files only under this folder; None disables them.
    allow_remote_media: fetch http(s) URLs from any host (off by default: a server that fetches
        URLs for its clients can be made to reach hosts the clients cannot).
    allowed_media_domains: a non-empty tuple turns remote fetching on for those hosts only.
        "example.com" matches that host exactly; "*.example.com" matches its subdomains (not
        example.com itself), so an operator widens the list only on purpose.
    allow_private_media_addresses: also fetch from loopback, private, link-local and other
        non-public addresses (the check is on the address each host resolves to).
    max_image_pixels / max_video_pixels: declared pixel bounds, checked before decoding.
    """

    allowed_local_media_path: Path | None = None
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    allow_remote_media: bool = False
    allowed_media_domains: tuple[str, ...] | None = None
    allow_private_media_addresses: bool = False
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS

    def __post_init__(self) -> None:
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path).expanduser().resolve()
            if not root.is_dir():
                raise ValueError(f"--allowed_local_media_path {root} is not a directory")
            object.__setattr__(self, "allowed_local_media_path", root)
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")
        for name in ("max_media_bytes", "max_image_pixels", "max_video_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        domains = self.allowed_media_domains
        if domains is not None:
            if isinstance(domains, str):
                raise ValueError("allowed_media_domains must be a list of host names, not a str")
            normalised = tuple(dict.fromkeys(_normalise_domain(d) for d in domains))
            object.__setattr__(self, "allowed_media_domains", normalised or None)

    @property
    def remote_media_enabled(self) -> bool:
        return self.allow_remote_media or bool(self.allowed_media_domains)
