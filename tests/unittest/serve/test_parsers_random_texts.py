"""Streamed == whole on seeded random texts built from tags, tag fragments and text.

The fixed cases show what the parsers yield; these texts hunt for chunk boundaries that the
fixed cases miss (a tag cut anywhere, tags in any order, malformed mixes).
"""

from __future__ import annotations

import json
import random

import pytest
from parser_chunks import chunks
from tool_parser_cases import TOOLS

from tensorrt_llm.serve.reasoning_parser import Qwen3ReasoningParser
from tensorrt_llm.serve.tool_parsers import HermesToolParser, Qwen3CoderToolParser, ToolParser

PIECES = [
    "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=", "<parameter=days>",
    "<parameter=tags>", "</parameter>", "</function>", "<think>", "</think>", "<tool_", "</para",
    "\n", " ", "x", "3", "<", ">", "{", "}", '"name": "f"', ", ", '"arguments": {"a": 1}',
    "[1]", "true", "null", "é🙂",
]  # fmt: skip
NUM_TEXTS = 300


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(PIECES, k=rng.randint(0, 25))) for _ in range(NUM_TEXTS)]


def _streamed_tools(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list]:
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for part in delta.tool_calls:
            call = calls.setdefault(part.index, [part.name or "", ""])
            call[1] += part.arguments or ""
    content = "".join(d.content or "" for d in deltas) or None
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("cls", [HermesToolParser, Qwen3CoderToolParser])
def test_tool_parsers(cls: type[ToolParser]) -> None:
    for i, text in enumerate(_texts(seed=11)):
        whole = cls.extract(text, TOOLS)
        for call in whole.calls:
            json.loads(call.arguments_json)
        expected = (whole.content, [(c.name, c.arguments_json) for c in whole.calls])
        for how in ("chars", f"random{i % 5}"):
            assert _streamed_tools(cls(TOOLS), chunks(text, how)) == expected, (text, how)


@pytest.mark.parametrize("starts", [False, True])
@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("tool_call_ends", [False, True])
def test_reasoning_parser(starts: bool, strip: bool, tool_call_ends: bool) -> None:
    for i, text in enumerate(_texts(seed=12)):
        expected = Qwen3ReasoningParser(starts, strip, tool_call_ends).parse(text)
        for how in ("chars", f"random{i % 5}"):
            parser = Qwen3ReasoningParser(starts, strip, tool_call_ends)
            parts = [parser.feed(piece) for piece in chunks(text, how)] + [parser.finish()]
            reasoning = "".join(r or "" for r, _ in parts) or None
            content = "".join(c or "" for _, c in parts) or None
            assert (reasoning, content) == expected, (text, how)
