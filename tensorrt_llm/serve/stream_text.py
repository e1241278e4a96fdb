"""Tag scanning shared by the streaming reasoning and tool-call parsers.

A streamed delta may end in the middle of a tag (`</thi`): the parsers hold such a suffix back
until the next delta says whether it is a tag or text, so no client ever sees half a tag.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_first(text: str, tags: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(position, tag) of the earliest of `tags` in text[start:], or None when none occurs."""
    best: tuple[int, str] | None = None
    for tag in tags:
        pos = text.find(tag, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, tag)
    return best


def held_back_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`.

    The caller has already looked for the whole tags, so a suffix that is a full tag cannot
    occur here; what is left is text that could still become a tag.
    """
    longest = max((len(tag) for tag in tags), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        suffix = text[-k:]
        if any(tag.startswith(suffix) and len(tag) > k for tag in tags):
            return k
    return 0


def scan_start(buffered: int, tags: Sequence[str]) -> int:
    """Where a re-scan of a grown buffer must begin to find tags that straddle the old end.

    Buffers inside tool calls grow until a closing tag arrives; scanning only their new tail
    keeps a long argument value linear instead of quadratic in its length.
    """
    longest = max((len(tag) for tag in tags), default=1)
    return max(0, buffered - longest + 1)
