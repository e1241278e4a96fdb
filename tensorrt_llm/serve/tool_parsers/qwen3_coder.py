"""`--tool_call_parser qwen3_coder`: the XML calls of Qwen3.5/3.6 and Qwen3-Coder.

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    value
    </parameter>
    </function>
    </tool_call>

Values are typed by the tool's schema (`param_types.py`) and the arguments are a JSON object
in the order the model wrote them (`json.dumps` spacing, non-ASCII kept); a parameter written
twice appears twice, since a streamed fragment cannot be taken back.

Choices, against vLLM's Qwen3CoderToolParser:
- `<tool_call>` not followed (after whitespace) by `<function=NAME>` is content, as is a
  name with a newline or `<` in it. Once `<function=NAME>` is read it is a call: the rest is
  read leniently, as vLLM does: text between tags is ignored, a value also ends at the next
  `<parameter=`, `</function>` or `</tool_call>`, and an output cut off inside a call still
  yields the call with the parameters read so far (a cut-off parameter name is dropped, a
  cut-off end tag is no part of the value);
- one `\\n` after `<parameter=ARG>` and one before `</parameter>` are template layout and
  removed (vLLM too); the rest of a string value is kept exactly;
- several `<function=...>` in one `<tool_call>` are several calls (vLLM too);
- `<function=` with no `<tool_call>` before it is content (vLLM guesses a call there);
- a call to a function not in `tools` is kept, its values as strings (vLLM too).

Streaming: the header (id, name) goes out as soon as `<function=NAME>` is read, with `{`; each
parameter follows once its value is complete (its type needs the whole text); `}` at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..stream_text import find_first, held_back_len, scan_start
from .base import TOOL_CALL_END, TOOL_CALL_START, ToolParser
from .param_types import convert_param_value

FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"

# What may end each part of a call, in the lenient reading described above.
_BODY_TAGS = (PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
_VALUE_TAGS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
_AFTER_FUNCTION_TAGS = (TOOL_CALL_END, FUNCTION_START)

_OPENED, _NAME, _BODY, _PARAM_NAME, _VALUE, _AFTER_FUNCTION = range(6)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    CALL_TRIGGER = f"{TOOL_CALL_START}\n{FUNCTION_START}"
    CALL_END = f"\n{FUNCTION_END}\n{TOOL_CALL_END}"
    ARGUMENTS_STYLE = "qwen_xml"  # <parameter=name>\nvalue\n</parameter> per argument

    @classmethod
    def call_begin(cls, function_name: str) -> str:
        return f"{cls.CALL_TRIGGER}{function_name}>\n"

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = _OPENED
        self._consumed = ""  # taken from the buffer before the call was confirmed
        self._scanned = 0  # how far into a buffered value the end tags were looked for
        self._function = ""
        self._index = -1
        self._num_params = 0
        self._param = ""
        self._steps: dict[int, Callable[[bool], bool]] = {
            _OPENED: self._step_opened,
            _NAME: self._step_name,
            _BODY: self._step_body,
            _PARAM_NAME: self._step_param_name,
            _VALUE: self._step_value,
            _AFTER_FUNCTION: self._step_after_function,
        }

    def _open_block(self, tag: str) -> None:
        super()._open_block(tag)
        self._state = _OPENED
        self._consumed = ""

    def _step_call(self, final: bool) -> bool:
        return self._steps[self._state](final)

    def _step_opened(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(FUNCTION_START):
            taken = len(self._buf) - len(rest) + len(FUNCTION_START)
            self._consumed, self._buf = self._buf[:taken], self._buf[taken:]
            self._state = _NAME
            return True
        if not final and FUNCTION_START.startswith(rest):
            return False  # whitespace or a partial `<function=` so far
        self._reject_block()
        return True

    def _step_name(self, final: bool) -> bool:
        pos = self._buf.find(">")
        name = self._buf if pos < 0 else self._buf[:pos]
        if "\n" in name or "<" in name or (pos >= 0 and not name.strip()) or (pos < 0 and final):
            self._reject_block(self._consumed)
            return True
        if pos < 0:
            return False
        self._buf = self._buf[pos + 1 :]
        self._function = name.strip()
        self._index = self._start_call(self._function)
        self._arguments(self._index, "{")
        self._num_params = 0
        self._state = _BODY
        return True

    def _step_body(self, final: bool) -> bool:
        found = find_first(self._buf, _BODY_TAGS)
        if found is None:
            if final:
                self._truncated()
            else:
                keep = held_back_len(self._buf, _BODY_TAGS)
                self._buf = self._buf[len(self._buf) - keep :]  # text between tags is ignored
            return False
        pos, tag = found
        self._buf = self._buf[pos + len(tag) :]
        if tag == PARAMETER_START:
            self._state = _PARAM_NAME
        else:
            self._close_function(tag)
        return True

    def _step_param_name(self, final: bool) -> bool:
        pos = self._buf.find(">")
        if pos < 0:
            if final:
                self._truncated()
            return False
        self._param = self._buf[:pos].strip()
        self._buf = self._buf[pos + 1 :]
        self._scanned = 0
        self._state = _VALUE
        return True

    def _step_value(self, final: bool) -> bool:
        found = find_first(self._buf, _VALUE_TAGS, self._scanned)
        if found is None:
            if final:
                # Cut off inside `</parameter>`: the fragment is the tag, not the value.
                cut = held_back_len(self._buf, _VALUE_TAGS)
                self._emit_param(self._buf[: len(self._buf) - cut])
                self._truncated()
            else:
                self._scanned = scan_start(len(self._buf), _VALUE_TAGS)
            return False
        pos, tag = found
        self._emit_param(self._buf[:pos])
        self._buf = self._buf[pos + len(tag) :]
        if tag == PARAMETER_END:
            self._state = _BODY
        elif tag == PARAMETER_START:
            self._state = _PARAM_NAME
        else:
            self._close_function(tag)
        return True

    def _step_after_function(self, final: bool) -> bool:
        found = find_first(self._buf, _AFTER_FUNCTION_TAGS)
        if found is None:
            keep = 0 if final else held_back_len(self._buf, _AFTER_FUNCTION_TAGS)
            self._buf = self._buf[len(self._buf) - keep :]
            if final:
                self._end_block()
            return False
        pos, tag = found
        self._buf = self._buf[pos + len(tag) :]
        if tag == TOOL_CALL_END:
            self._end_block()
        else:
            # Another function in the same <tool_call>: a new call, confirmed by its name.
            self._block_tag, self._consumed = FUNCTION_START, ""
            self._state = _NAME
        return True

    def _emit_param(self, text: str) -> None:
        if text.startswith("\n"):
            text = text[1:]
        if text.endswith("\n"):
            text = text[:-1]
        schema = self.schemas.get(self._function, {}).get(self._param)
        value = convert_param_value(text, schema)
        key = json.dumps(self._param, ensure_ascii=False)
        separator = ", " if self._num_params else ""
        self._num_params += 1
        self._arguments(self._index, f"{separator}{key}: {json.dumps(value, ensure_ascii=False)}")

    def _close_function(self, tag: str) -> None:
        self._arguments(self._index, "}")
        if tag == FUNCTION_END:
            self._state = _AFTER_FUNCTION
        else:
            self._end_block()

    def _truncated(self) -> None:
        """The output ended inside a call: close it with what was read."""
        self._buf = ""
        self._close_function(TOOL_CALL_END)
