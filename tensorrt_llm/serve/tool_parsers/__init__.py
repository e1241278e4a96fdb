"""`--tool_call_parser`: generated text -> OpenAI `tool_calls` (and the content around them).

Per request: `parser = get_tool_parser(name)(tools)`, then `parser.feed(delta)` for each text
delta and `parser.finish()` at the end; or `get_tool_parser(name).extract(text, tools)` for a
whole output. `tools` is the request's OpenAI `tools` list as plain dicts.
"""

from __future__ import annotations

import re

from .base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
)
from .hermes import HermesToolParser
from .qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Qwen3CoderToolParser.name: Qwen3CoderToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known parsers: {known}") from None


def default_tool_parser(model_type_or_architecture: str) -> str:
    """The parser of a checkpoint's format, from its `model_type`, architecture or name.

    Qwen3.5/3.6 (`qwen3_5`, `qwen3_5_moe`, `Qwen3_5...ForConditionalGeneration`) and Qwen3-Coder
    write XML calls: `qwen3_coder`. Qwen2, Qwen2.5(-VL), Qwen3, Qwen3-MoE, Qwen3-VL and anything
    else write Hermes JSON: `hermes`. Qwen3-Coder's config says `qwen3_moe`, like Qwen3's, so
    only a name with `coder` in it (e.g. the model id) can pick it out.
    """
    # A Hugging Face id's org says nothing; `.`/`-` spell `_` in names (`Qwen3.5-27B`).
    key = model_type_or_architecture.strip().lower().rsplit("/", 1)[-1]
    key = re.sub(r"[.\-\s]", "_", key)
    if key.startswith(("qwen3_5", "qwen3_6")) or (key.startswith("qwen3") and "coder" in key):
        return Qwen3CoderToolParser.name
    return HermesToolParser.name


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Qwen3CoderToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamDelta",
    "default_tool_parser",
    "get_tool_parser",
]
