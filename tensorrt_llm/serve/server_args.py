"""Defaults of the server's per-request bounds, and the media settings built from its flags.

Kept apart from `commands/serve.py` so the app (and tests building it from a namespace) use
the same defaults as the command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .media import MediaConfig

# Media items per prompt when --limit_mm_per_prompt (and the LLM's own limit) is not given.
DEFAULT_MM_LIMITS: dict[str, int] = {"image": 16, "video": 2}
# Prompts of one /v1/completions request, and prompts x n of one request.
DEFAULT_MAX_PROMPTS = 64
DEFAULT_MAX_SEQUENCES = 256


def arg_or(args: Any, name: str, default: Any = None) -> Any:
    """`args.name`, or `default` when it is missing or None (a flag left unset, or an app
    built from a namespace without it)."""
    value = getattr(args, name, None)
    return default if value is None else value


def media_config_from_args(args: Any) -> MediaConfig:
    """The MediaConfig of the server's flags; a flag left unset keeps MediaConfig's default."""
    kwargs: dict[str, Any] = {}
    root = arg_or(args, "allowed_local_media_path")
    if root:
        kwargs["allowed_local_media_path"] = Path(root)
    for flag, field in (
        ("media_fetch_timeout", "fetch_timeout_s"),
        ("max_media_bytes", "max_media_bytes"),
        ("max_media_pixels", "max_image_pixels"),
        ("max_video_pixels", "max_video_pixels"),
    ):
        value = arg_or(args, flag)
        if value is not None:
            kwargs[field] = value
    for flag in ("allow_remote_media", "allow_private_media_addresses"):
        kwargs[flag] = bool(arg_or(args, flag))
    domains = arg_or(args, "allowed_media_domains")
    if domains:
        kwargs["allowed_media_domains"] = tuple(domains)
    return MediaConfig(**kwargs)
