"""`tool_choice` "required" or a named function, enforced with structured output: the output is
guided to JSON (a named function's arguments; for "required" a list of `{"name",
"parameters"}` calls) and read back into OpenAI `tool_calls`, with no tool-call parser.

`ForcedCallStream` reads that JSON as it is generated, so a stream carries each call's header
(id, name) as soon as the name is complete and then its arguments in fragments, as OpenAI
streams calls; the fragments are the generated text of the arguments object itself, so their
concatenation is the call's `arguments` in the whole response too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..guided_decoding_params import GuidedDecodingParams
from .openai_protocol import APIError, ChatCompletionRequest
from .tool_parsers.base import new_call_id

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_function(body: ChatCompletionRequest) -> str | None:
    """The named function `tool_choice` forces (None: not a named choice)."""
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return None
    return choice.function.name


def tool_parameters(tool: Any) -> dict[str, Any]:
    """A tool's arguments schema (any object when it gives none)."""
    return tool.function.parameters or ANY_OBJECT


def forced_tool_guide(body: ChatCompletionRequest) -> GuidedDecodingParams | None:
    """The JSON schema that makes the output a valid call, for "required" / named choices."""
    tools = body.tools or []
    name = forced_function(body)
    if name is not None:
        match = [t for t in tools if t.function.name == name]
        if not match:
            raise APIError(
                400, f"tool_choice names {name!r}, which is not one of the request's tools",
                code="invalid_request", param="tool_choice",
            )  # fmt: skip
        return GuidedDecodingParams(json=tool_parameters(match[0]))
    if body.tool_choice != "required" or not tools:
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.function.name]}, "parameters": tool_parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return GuidedDecodingParams(json=schema)


# The head of one call of the "required" list, before its arguments object: the guided JSON
# writes the schema's properties in their order (name, then parameters), with any whitespace.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


class ForcedCallStream:
    """The OpenAI `tool_calls` deltas of a forced output, fed as text deltas.

    `name`: the forced function (the whole output is its arguments object), or None for
    "required" (a JSON list of `{"name", "parameters"}` objects). A scanner follows JSON depth
    and strings over the text: a call's header goes out when its arguments object opens (its
    name is then complete), and each piece of the arguments as it arrives. A named choice's
    leading and trailing whitespace is not part of the arguments (trailing whitespace is held
    until more text follows)."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.text = ""
        self.calls = 0  # call headers sent
        self.closed = False  # the top-level JSON value is complete
        self.malformed = False  # a list element was not a {"name", "parameters"} call
        self._scan = 0  # next character the scanner reads
        self._depth = 0
        self._in_str = self._escape = False
        self._object_at = -1  # where the current element of a list starts
        self._args_at = -1  # where the current call's arguments start (-1: none open)
        self._sent = 0  # the current call's arguments are sent up to here

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        out: list[dict[str, Any]] = []
        while self._scan < len(self.text):
            self._step(out)
        if self._args_at >= 0:
            end = len(self.text.rstrip()) if self.name is not None else self._scan
            out += self._fragment(end)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Deltas still held back at the end of the output (none: held whitespace is dropped)."""
        return []

    def _step(self, out: list[dict[str, Any]]) -> None:
        """Read one character; open and close calls at their boundaries."""
        pos, ch = self._scan, self.text[self._scan]
        self._scan += 1
        if self._in_str:
            self._in_str = self._escape or ch != '"'
            self._escape = not self._escape and ch == "\\"
            return
        if ch == '"':
            self._in_str = True
        if self.name is not None:  # the arguments are the whole value
            if self.calls == 0 and not ch.isspace():
                out.append(self._header(self.name))
                self._args_at = self._sent = pos
        elif ch == "{" and self._depth == 1:
            self._object_at = pos
        elif ch == "{" and self._depth == 2 and self._object_at >= 0:
            head = _CALL_HEAD.fullmatch(self.text, self._object_at, pos)
            if head is None:
                self.malformed = True
            else:
                out.append(self._header(json.loads(head.group(1))))
                self._args_at = self._sent = pos
        elif ch == "}" and self._depth == 3 and self._args_at >= 0:  # the arguments close
            out += self._fragment(pos + 1)
            self._args_at = -1
        if ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1
            self.closed = self._depth == 0
            if ch == "}" and self._depth == 1:
                self._object_at = -1

    def _header(self, name: str) -> dict[str, Any]:
        index, self.calls = self.calls, self.calls + 1
        return {"index": index, "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}  # fmt: skip

    def _fragment(self, end: int) -> list[dict[str, Any]]:
        if end <= self._sent:
            return []
        piece, self._sent = self.text[self._sent : end], end
        return [{"index": self.calls - 1, "function": {"arguments": piece}}]


def forced_calls(text: str, name: str | None) -> list[dict[str, Any]] | None:
    """OpenAI `tool_calls` of a whole guided output (None: the JSON did not close, e.g. cut by
    length, or holds no call): the stream's deltas put together."""
    stream = ForcedCallStream(name)
    deltas = stream.feed(text) + stream.finish()
    if not stream.closed or not stream.calls or stream.malformed:
        return None
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if "id" in delta:
            calls.append({k: v for k, v in delta.items() if k != "index"})
            calls[-1]["function"] = dict(delta["function"])
        else:
            calls[-1]["function"]["arguments"] += delta["function"]["arguments"]
    return calls
