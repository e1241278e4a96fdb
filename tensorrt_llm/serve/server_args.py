"""Defaults of the server's per-request bounds, the media settings built from its flags, and
the `--extra_llm_api_options` YAML file of LLM arguments.

Kept apart from `commands/serve.py` so the app (and tests building it from a namespace) use
the same defaults as the command line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

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


def parse_speculative_config_arg(text: str) -> dict[str, Any]:
    """`--speculative_config`: a JSON object, or the path of a YAML (or JSON) file holding one.
    The fields are checked by LlmArgs (`MTPDecodingConfig`)."""
    where = f"--speculative_config {text}"
    if text.strip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{where}: not valid JSON ({exc.msg})") from None
    else:
        try:
            with open(text, encoding="utf-8") as f:
                value = yaml.safe_load(f)
        except OSError as exc:
            msg = f"{where}: neither a JSON object nor a readable file ({exc.strerror or exc})"
            raise argparse.ArgumentTypeError(msg) from None
        except yaml.YAMLError as exc:
            raise argparse.ArgumentTypeError(f"{where}: not valid YAML ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def load_llm_api_options(path: str | None, flag_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The LLM(...) arguments of the YAML file at `path` ({} without one).

    Keys must be LLM argument names (nested dicts such as `kv_cache_config` are passed as they
    are; LlmArgs builds its configs from them); their values are checked when the LLM is built.
    NOTE: a key that `flag_kwargs` (the flags given) also sets is an error, not a silent
    override either way: TensorRT-LLM lets the file win, most tools let the flag win.
    """
    if path is None:
        return {}
    from ..llmapi.llm_args import LlmArgs

    where = f"--extra_llm_api_options {path}"
    try:
        with open(path, encoding="utf-8") as f:
            options = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(
            f"{where}: expected a mapping of LLM arguments, got {type(options).__name__}"
        )
    bad = sorted(str(k) for k in options if not isinstance(k, str))
    valid = [name for name in LlmArgs.field_names() if name != "model"]
    unknown = bad or sorted(set(options) - set(valid))
    if unknown:
        model = " (the model is the command's positional argument)" if "model" in unknown else ""
        raise ValueError(
            f"{where}: unknown LLM argument(s) {unknown}{model}; valid arguments: {valid}"
        )
    both = sorted(set(options) & set(flag_kwargs))
    if both:
        raise ValueError(f"{where}: {both} also given on the command line; give each in one place")
    return dict(options)
