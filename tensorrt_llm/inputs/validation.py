"""Checks of caller-supplied prompt fields, each raising a clear error that names the field.

Type mistakes (a float token id, a string where a flag belongs) raise TypeError; values of the
right type out of their range raise ValueError. Messages quote the field path the caller wrote
(`prompt_token_ids[3]`, `messages[0]['role']`, `mm_processor_kwargs['fps']`) and never an
internal exception text, so they can go back to a client as they are.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

# Roles the Qwen chat templates render (the Qwen3 ones branch on exactly these; `developer`
# is OpenAI's newer name for a system turn and renders like one where a template knows it).
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "developer")
CONTENT_PART_TYPES: tuple[str, ...] = ("text", "image", "image_url", "video")

# Upper bounds of the per-request processor knobs. min_pixels may *upscale* every image (and
# every frame) to that area, so it is bounded like a decoded image is (32 Mpx).
MAX_PROCESSOR_PIXELS = 32 * 1024 * 1024
MIN_FPS, MAX_FPS = 1e-3, 1000.0
MAX_NUM_FRAMES = 1 << 16


# Token ids are int32 on the device; anything larger is no token of any vocabulary.
MAX_TOKEN_ID = 2**31 - 1


def _type_name(value: Any) -> str:
    return type(value).__name__


def _shown(value: int) -> str:
    # Printing a huge int is slow and, past 4300 digits, itself an error.
    return str(value) if abs(value) < 10**18 else f"an integer of {int(value).bit_length()} bits"


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True is never meant as a token id or a pixel count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def check_prompt_token_ids(ids: Any, field: str = "prompt_token_ids") -> list[int]:
    """A flat list of non-negative ints (numpy ints and a 1-D integer tensor accepted)."""
    if isinstance(ids, np.ndarray) or hasattr(ids, "tolist") and hasattr(ids, "dtype"):
        # An array or tensor: its elements as Python values, so the checks below see a float
        # as a float, a bool as a bool and a 2-D array as nested lists.
        ids = ids.tolist()
    if not isinstance(ids, list | tuple):
        raise TypeError(f"{field} must be a list of ints, got {_type_name(ids)}")
    # The common case, plain ints in range, without the per-element ABC check below (which
    # costs ~0.45 ms per 1000 ids, paid twice per request on the submit path); anything
    # else takes the loop, which names the first bad element.
    if all(type(token) is int for token in ids) and (
        not ids or (min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID)
    ):
        return list(ids)
    out: list[int] = []
    for i, token in enumerate(ids):
        if not _is_int(token):
            raise TypeError(f"{field}[{i}] must be an int, got {_type_name(token)}")
        if not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"{field}[{i}] must lie in [0, {MAX_TOKEN_ID}], got {_shown(token)}")
        out.append(int(token))
    return out


def check_chat_messages(messages: Any, field: str = "messages") -> None:
    """Every message is {"role": <known role>, "content": str | [parts]}."""
    if not isinstance(messages, list | tuple) or not messages:
        raise TypeError(f"{field} must be a non-empty list of chat messages")
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise TypeError(
                f"{where} must be a dict with 'role' and 'content', got {_type_name(message)}"
            )
        role = message.get("role")
        if not isinstance(role, str):
            raise TypeError(f"{where}['role'] must be a string, got {_type_name(role)}")
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}['role'] {role[:32]!r} is not one of {list(CHAT_ROLES)}")
        if "content" not in message:
            raise ValueError(f"{where} has no 'content'")
        content = message["content"]
        if isinstance(content, str):
            continue
        if not isinstance(content, list | tuple):
            raise TypeError(
                f"{where}['content'] must be a string or a list of parts, got {_type_name(content)}"
            )
        for j, part in enumerate(content):
            _check_part(part, f"{where}['content'][{j}]")


def _check_part(part: Any, where: str) -> None:
    if not isinstance(part, Mapping):
        raise TypeError(f"{where} must be a dict with a 'type', got {_type_name(part)}")
    kind = part.get("type")
    if kind not in CONTENT_PART_TYPES:
        shown = kind[:32] if isinstance(kind, str) else _type_name(kind)
        raise ValueError(f"{where}['type'] {shown!r} is not one of {list(CONTENT_PART_TYPES)}")
    if kind == "text" and not isinstance(part.get("text"), str):
        raise TypeError(f"{where}['text'] must be a string, got {_type_name(part.get('text'))}")


def chat_text_bytes(messages: list[Any]) -> int:
    """UTF-8 bytes of all the text a conversation carries (string content and text parts)."""
    total = 0
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        total += sum(utf8_len(v) for k, v in message.items() if k != "role" and isinstance(v, str))
        content = message.get("content")
        if isinstance(content, list | tuple):
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                if isinstance(text, str):
                    total += utf8_len(text)
    return total


def utf8_len(text: str) -> int:
    # surrogatepass: a lone surrogate still counts (and fails later with a clear error).
    return len(text.encode("utf-8", errors="surrogatepass"))


# ------------------------------------------------------------------- mm_processor_kwargs


def _check_pixels(key: str, value: Any) -> None:
    if not _is_int(value):
        raise TypeError(f"mm_processor_kwargs[{key!r}] must be an int, got {_type_name(value)}")
    if not 1 <= value <= MAX_PROCESSOR_PIXELS:
        raise ValueError(
            f"mm_processor_kwargs[{key!r}] must lie in [1, {MAX_PROCESSOR_PIXELS}], got "
            f"{_shown(value)}"
        )


def _check_fps(key: str, value: Any) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool | np.bool_):
        raise TypeError(f"mm_processor_kwargs[{key!r}] must be a number, got {_type_name(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not (math.isfinite(number) and MIN_FPS <= number <= MAX_FPS):
        raise ValueError(
            f"mm_processor_kwargs[{key!r}] must be a finite number in [{MIN_FPS}, {MAX_FPS}], "
            f"got {number}"
        )


def _check_num_frames(key: str, value: Any) -> None:
    if not _is_int(value):
        raise TypeError(f"mm_processor_kwargs[{key!r}] must be an int, got {_type_name(value)}")
    if not 1 <= value <= MAX_NUM_FRAMES:
        raise ValueError(
            f"mm_processor_kwargs[{key!r}] must lie in [1, {MAX_NUM_FRAMES}], got {_shown(value)}"
        )


def _check_flag(key: str, value: Any) -> None:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"mm_processor_kwargs[{key!r}] must be a bool, got {_type_name(value)}")


_KWARG_CHECKS = {
    "min_pixels": _check_pixels,
    "max_pixels": _check_pixels,
    "fps": _check_fps,
    "num_frames": _check_num_frames,
    "do_resize": _check_flag,
    "do_sample_frames": _check_flag,
}
MM_PROCESSOR_KWARG_KEYS = frozenset(_KWARG_CHECKS)


def check_mm_processor_kwargs(kwargs: Any) -> dict[str, Any]:
    """Type and range of every known key; unknown keys are left to the processor to name.

    `None` values mean "not given" and are dropped. Returns a plain dict copy.
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"mm_processor_kwargs must be a dict, got {_type_name(kwargs)}")
    out = {}
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise TypeError(f"mm_processor_kwargs keys must be strings, got {_type_name(key)}")
        if value is None:
            continue
        check = _KWARG_CHECKS.get(key)
        if check is not None:
            check(key, value)
        out[key] = value
    low, high = out.get("min_pixels"), out.get("max_pixels")
    if low is not None and high is not None and low > high:
        raise ValueError(
            f"mm_processor_kwargs['min_pixels']={low} exceeds mm_processor_kwargs['max_pixels']="
            f"{high}"
        )
    return out


# ------------------------------------------------------------------- prompt length from bytes

# NOTE: a normalizer may shrink text before it is split into tokens (NFC/NFKC compose a few
# code points into one), so the bound from the longest token is widened by this factor.
_NORMALIZER_SLACK = 4


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound of the UTF-8 bytes one token can cover (at least 1).

    The vocabulary strings are used as they are: a byte-level token is spelled with one or
    two UTF-8 bytes per byte it stands for, and a byte-fallback token like `<0x0A>` with
    more, so this never underestimates.
    """
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    longest = max((utf8_len(token) for token in vocab if isinstance(token, str)), default=0)
    return max(1, longest)


def max_prompt_bytes(max_seq_len: int, token_bytes: int) -> int:
    """Text longer than this (in UTF-8 bytes) is more than `max_seq_len` tokens for sure."""
    return max_seq_len * token_bytes * _NORMALIZER_SLACK


def prompt_text_bytes(prompt: Any) -> int:
    """UTF-8 bytes of a prompt's text: a string, or the text of chat messages."""
    if isinstance(prompt, str):
        return utf8_len(prompt)
    if isinstance(prompt, list | tuple):
        return chat_text_bytes(list(prompt))
    return 0
