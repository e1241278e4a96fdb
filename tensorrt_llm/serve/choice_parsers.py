"""One chat choice's generated text -> OpenAI message fields: `reasoning_content` split off by the
`--reasoning_parser`, then `tool_calls` taken out of the rest by the `--tool_call_parser` (when
the request has tools), for a whole output or a stream of text deltas.

`ChoiceParsing` is the per-request configuration the server builds; `ChoiceParser` the state of
one choice (streams keep one per choice index).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .forced_tools import ForcedCallStream, forced_calls
from .reasoning_parser import Qwen3ReasoningParser, prompt_opens_reasoning
from .tool_parsers import ToolParser

FINISH_TOOL_CALLS = "tool_calls"


@dataclass
class MessageDelta:
    """Fields of one streamed `delta` (None: absent from this chunk)."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def merge(self, other: MessageDelta) -> MessageDelta:
        """This delta followed by `other` (a call's index appears once: fragments joined)."""
        calls = [dict(c) for c in self.tool_calls]
        for call in other.tool_calls:
            same = next((c for c in calls if c["index"] == call["index"]), None)
            if same is None:
                calls.append(dict(call))
                continue
            function = dict(same.get("function", {}))
            for key, value in call.get("function", {}).items():
                function[key] = function.get(key, "") + value if key == "arguments" else value
            same.update({k: v for k, v in call.items() if k != "function"}, function=function)
        return MessageDelta(_join(self.content, other.content), _join(
            self.reasoning_content, other.reasoning_content), calls)  # fmt: skip

    @property
    def is_empty(self) -> bool:
        return self.content is None and self.reasoning_content is None and not self.tool_calls


def _join(a: str | None, b: str | None) -> str | None:
    return b if a is None else a if b is None else a + b


@dataclass(frozen=True)
class ChoiceParsing:
    """How a request's chat outputs are parsed: the reasoning parser class (or None), and the
    tool parser class with the request's tools (None: tools absent or tool_choice "none")."""

    reasoning: type[Qwen3ReasoningParser] | None = None
    tool_parser: type[ToolParser] | None = None
    tools: list[dict[str, Any]] | None = None
    single_call: bool = False  # parallel_tool_calls=false: only the first call is returned
    # tool_choice "required" / named: the output is guided JSON of the call(s) (forced_tools.py)
    forced: bool = False
    forced_name: str | None = None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_parser is not None or self.forced

    def parser(self, prompt_tail: str = "") -> ChoiceParser:
        """A parser for one choice; `prompt_tail` (the rendered prompt's end) says whether the
        output starts inside `<think>` (Qwen3.5/3.6 templates open it)."""
        return ChoiceParser(self, prompt_opens_reasoning(prompt_tail))


class ChoiceParser:
    def __init__(self, parsing: ChoiceParsing, starts_in_reasoning: bool) -> None:
        self.parsing = parsing
        self.starts_in_reasoning = starts_in_reasoning
        self._reasoning = (
            parsing.reasoning(starts_in_reasoning=starts_in_reasoning)
            if parsing.reasoning is not None
            else None
        )
        self._tools = (
            parsing.tool_parser(parsing.tools) if parsing.tool_parser is not None else None
        )
        self.tools_called = False
        self._forced = ForcedCallStream(parsing.forced_name) if parsing.forced else None

    def _forced_whole(self, text: str) -> MessageDelta:
        calls = forced_calls(text, self.parsing.forced_name)
        self.tools_called = calls is not None and self.parsing.forced_name is None
        return MessageDelta(tool_calls=calls) if calls else MessageDelta(content=text or None)

    # ---- whole outputs
    def whole(self, text: str) -> MessageDelta:
        """(content, reasoning_content, tool_calls) of a whole output."""
        if self.parsing.forced:
            return self._forced_whole(text)
        reasoning, content = (
            self._reasoning.parse(text) if self._reasoning is not None else (None, text or None)
        )
        calls: list[dict[str, Any]] = []
        if self.parsing.tool_parser is not None and content:
            extracted = self.parsing.tool_parser.extract(content, self.parsing.tools)
            content = extracted.content
            calls = [c.to_openai() for c in extracted.calls]
            calls = calls[:1] if self.parsing.single_call else calls
            self.tools_called = bool(calls)
        return MessageDelta(content, reasoning, calls)

    # ---- streams
    def feed(self, delta: str) -> MessageDelta:
        """The message fields of the next text delta (text that may still be a tag is held)."""
        if self._forced is not None:  # guided JSON of the call(s): headers, then arguments
            calls = self._forced.feed(delta)
            self.tools_called = self._forced.calls > 0 and self.parsing.forced_name is None
            return MessageDelta(tool_calls=calls)
        if self._reasoning is None:
            return self._tool_step(delta, final=False)
        reasoning, content = self._reasoning.feed(delta)
        out = self._tool_step(content or "", final=False)
        return MessageDelta(reasoning_content=reasoning).merge(out)

    def finish(self) -> MessageDelta:
        """Flush everything held back at the end of the output."""
        if self._forced is not None:
            if self._forced.calls == 0:  # no call came out: the text is content, as whole
                return MessageDelta(content=self._forced.text or None)
            return MessageDelta(tool_calls=self._forced.finish())
        if self._reasoning is None:
            return self._tool_step("", final=True)
        reasoning, content = self._reasoning.finish()
        out = self._tool_step(content or "", final=True)
        return MessageDelta(reasoning_content=reasoning).merge(out)

    def _tool_step(self, text: str, final: bool) -> MessageDelta:
        if self._tools is None:
            return MessageDelta(content=text or None)
        step = self._tools.feed(text) if text else None
        deltas = [d for d in (step, self._tools.finish() if final else None) if d is not None]
        out = MessageDelta()
        for d in deltas:
            calls = [c.to_openai() for c in d.tool_calls]
            if self.parsing.single_call:
                calls = [c for c in calls if c["index"] == 0]
            self.tools_called = self.tools_called or bool(calls)
            out = out.merge(MessageDelta(content=d.content, tool_calls=calls))
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools ("stop" for a
        named tool_choice, as OpenAI answers it)."""
        return FINISH_TOOL_CALLS if reason == "stop" and self.tools_called else reason
