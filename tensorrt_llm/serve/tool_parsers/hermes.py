"""`--tool_call_parser hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The format of Qwen2.5, Qwen3 (up to the 2507 releases) and Qwen3-VL. Choices, against vLLM's
Hermes2ProToolParser:
- a call is judged on its own: a block whose body is not a JSON object with a string `name` is
  content (vLLM turns the whole output into content when any call is bad);
- `arguments` may be missing (`{}`), an object, or a string holding a JSON object (some
  fine-tunes write that); anything else makes the block content. `parameters` is read when
  `arguments` is absent (some models spell it so);
- a block cut off by the end of the output is still a call when its body parses (vLLM too);
- a call to a function not in `tools` is kept (vLLM too): the client sees what was asked for.
The arguments are re-serialised (`json.dumps`, non-ASCII kept), not copied from the text.

Streaming: a JSON body can only be judged once it is complete, so a call is sent when its
`</tool_call>` arrives (or at `finish()`): one delta with the id, the name and all the
arguments. Content around calls streams as it comes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..stream_text import scan_start
from .base import TOOL_CALL_END, TOOL_CALL_START, ToolParser
from .param_types import strict_json_loads


def parse_hermes_body(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call body, or None when it is no call."""
    try:
        obj = strict_json_loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = strict_json_loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


class HermesToolParser(ToolParser):
    name = "hermes"
    CALL_TRIGGER = TOOL_CALL_START
    CALL_END = "}\n" + TOOL_CALL_END
    ARGUMENTS_STYLE = "json"

    @classmethod
    def call_begin(cls, function_name: str) -> str:
        # As the Qwen templates ask for it: {"name": ..., "arguments": ...} on its own line.
        return f'{TOOL_CALL_START}\n{{"name": {json.dumps(function_name)}, "arguments": '

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._scanned = 0  # how far into the buffered body `</tool_call>` was looked for

    def _step_call(self, final: bool) -> bool:
        pos = self._buf.find(TOOL_CALL_END, self._scanned)
        if pos < 0 and not final:
            self._scanned = scan_start(len(self._buf), (TOOL_CALL_END,))
            return False
        self._scanned = 0
        body = self._buf if pos < 0 else self._buf[:pos]
        parsed = parse_hermes_body(body)
        if parsed is None:
            self._reject_block()
            return True
        self._buf = "" if pos < 0 else self._buf[pos + len(TOOL_CALL_END) :]
        index = self._start_call(parsed[0])
        self._arguments(index, parsed[1])
        self._end_block()
        return True
