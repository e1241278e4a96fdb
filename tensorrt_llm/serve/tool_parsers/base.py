"""What every tool-call parser shares: the result types, the text outside calls, the deltas.

A parser is one object per request, built with the request's `tools`. It reads generated text
as a stream (`feed(delta)` ... `finish()`); `extract(text, tools)` is the same machine fed the
whole text at once, so streaming and non-streaming results cannot drift apart.

Text outside calls is content, with two rules (the same in both modes):
- a `<tool_call>` whose body is not a call of the parser's format is content, tags and all:
  a malformed call never raises and never disappears;
- whitespace touching a call (the `\\n` the templates put before and after each one) is dropped,
  except that where content follows a call, the whitespace that preceded the call stays as
  the separator (`A\\n<call>\\nB` -> `A\\nB`). An output without calls is returned verbatim.
vLLM's parsers keep only the text before the first call; ours keep all of it (minus that
whitespace), so nothing the model wrote outside calls is lost.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..stream_text import held_back_len

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCall:
    """One complete call; `arguments_json` is the OpenAI `function.arguments` string."""

    id: str
    name: str
    arguments_json: str
    type: str = "function"

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments_json},
        }


@dataclass
class ExtractedToolCalls:
    """A whole output split into content and calls (non-streaming)."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


@dataclass
class ToolCallDelta:
    """One entry of an OpenAI stream chunk's `delta.tool_calls`.

    The first delta of a call carries `id`, `type` and `name`; later ones only `arguments`
    fragments, whose concatenation is the call's final `arguments_json`.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, str] = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        if function:
            out["function"] = function
        return out


@dataclass
class ToolStreamDelta:
    """What one `feed`/`finish` produced: a content delta and call deltas (each index once)."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.content is None and not self.tool_calls


def new_call_id() -> str:
    """A fresh OpenAI-style call id (`call_` + 24 hex digits, as vLLM makes them)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_parameter_schemas(
    tools: Sequence[Mapping[str, Any]] | None,
) -> dict[str, dict[str, Any]]:
    """{function name: {parameter name: JSON schema}} of OpenAI `tools` entries (as dicts)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[function["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


class ToolParser(ABC):
    """The streaming machine: the state outside calls here, the states inside in subclasses.

    Subclasses implement `_step_call(final)`: consume from `self._buf` while inside a call and
    return whether anything changed. They report through `_start_call` and `_arguments`, and
    leave the call with `_end_block` (a call) or `_reject_block` (no call after all).
    """

    name: ClassVar[str]
    # The format a guided call must take to be read back as a call (strict_tools.py): the
    # text that starts any call, the text before one named function's arguments, the text
    # after them, and how the arguments are written ("json", or xgrammar's "qwen_xml").
    CALL_TRIGGER: ClassVar[str]
    CALL_END: ClassVar[str]
    ARGUMENTS_STYLE: ClassVar[str]

    @classmethod
    @abstractmethod
    def call_begin(cls, function_name: str) -> str:
        """The text of a call to `function_name` up to its arguments."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.schemas = tool_parameter_schemas(tools)
        self._buf = ""  # text fed but not yet consumed
        self._inside = False  # between an opening tag and the end of its call
        self._block_tag = ""  # the opening tag of the block being read, for `_reject_block`
        self._num_calls = 0
        self._held_ws = ""  # trailing whitespace of content: sent only if more content follows
        self._skip_ws = False  # just after a call: its leading whitespace is dropped
        self._out_content: list[str] = []
        self._out_calls: list[ToolCallDelta] = []

    @classmethod
    def extract(
        cls, text: str, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> ExtractedToolCalls:
        """Content and calls of a whole output."""
        parser = cls(tools)
        deltas = [parser.feed(text), parser.finish()]
        content = "".join(d.content for d in deltas if d.content is not None)
        calls: dict[int, ToolCall] = {}
        for delta in deltas:
            for part in delta.tool_calls:
                call = calls.get(part.index)
                if call is None:
                    assert part.id is not None and part.name is not None
                    call = calls[part.index] = ToolCall(part.id, part.name, "")
                call.arguments_json += part.arguments or ""
        return ExtractedToolCalls(content or None, [calls[i] for i in sorted(calls)])

    def feed(self, delta: str) -> ToolStreamDelta:
        """Deltas of the next piece of generated text."""
        self._buf += delta
        self._advance(final=False)
        return self._take()

    def finish(self) -> ToolStreamDelta:
        """Deltas of the end of the stream: held-back text, the close of a truncated call."""
        self._advance(final=True)
        if self._held_ws and not self._num_calls:
            self._emit_content(self._held_ws)
        self._held_ws = ""
        return self._take()

    @abstractmethod
    def _step_call(self, final: bool) -> bool:
        """Consume text inside a call; False when it must wait for more."""

    def _advance(self, final: bool) -> None:
        while True:
            progressed = self._step_call(final) if self._inside else self._step_outside(final)
            if not progressed:
                return

    def _step_outside(self, final: bool) -> bool:
        pos = self._buf.find(TOOL_CALL_START)
        if pos >= 0:
            self._content(self._buf[:pos])
            self._buf = self._buf[pos + len(TOOL_CALL_START) :]
            self._open_block(TOOL_CALL_START)
            return True
        keep = 0 if final else held_back_len(self._buf, (TOOL_CALL_START,))
        self._content(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _open_block(self, tag: str) -> None:
        """Enter a block that is not a call yet (its format still has to be confirmed)."""
        self._inside = True
        self._block_tag = tag

    def _reject_block(self, consumed: str = "") -> None:
        """The block is no call: its opening tag is content, the rest is read again outside.

        `consumed` is what the subclass already took out of the buffer after the tag.
        """
        self._inside = False
        self._content(self._block_tag)
        self._buf = consumed + self._buf

    def _end_block(self) -> None:
        """Back outside after a call; whitespace right after it is dropped."""
        self._inside = False
        self._skip_ws = True

    def _content(self, text: str) -> None:
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        body = text.rstrip()
        if not body:
            self._held_ws += text
            return
        self._emit_content(self._held_ws + body)
        self._held_ws = text[len(body) :]

    def _emit_content(self, text: str) -> None:
        self._out_content.append(text)

    def _start_call(self, name: str) -> int:
        """A new call: its header delta (whitespace held before it waits for more content)."""
        index = self._num_calls
        self._num_calls += 1
        self._out_calls.append(ToolCallDelta(index, id=new_call_id(), name=name))
        return index

    def _arguments(self, index: int, fragment: str) -> None:
        last = self._out_calls[-1] if self._out_calls else None
        if last is not None and last.index == index:
            last.arguments = (last.arguments or "") + fragment
        else:
            self._out_calls.append(ToolCallDelta(index, arguments=fragment))

    def _take(self) -> ToolStreamDelta:
        content = "".join(self._out_content)
        out = ToolStreamDelta(content or None, self._out_calls)
        self._out_content, self._out_calls = [], []
        return out
