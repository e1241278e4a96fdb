"""`--reasoning_parser`: the model's `<think>...</think>` text -> OpenAI `reasoning_content`.

One parser object per request. `parse(text)` splits a whole output; `feed(delta)` splits a
stream of text deltas and `finish()` flushes what the stream held back. The two agree: the
concatenation of everything `feed`/`finish` returned equals what `parse` returns for the
same text, whatever the chunking.

Behaviour of the `qwen3` parser (checked against vLLM's Qwen3ReasoningParser):
- Qwen3.5/3.6 templates end the prompt inside reasoning (`...<|im_start|>assistant\\n<think>\\n`),
  so the output opens with no tag: `starts_in_reasoning=True` (see `prompt_opens_reasoning`).
  A `<think>` the model writes itself at the very start of such an output is dropped too.
- Otherwise text is content until a `<think>`; text before it stays content (vLLM drops it,
  we would rather not lose what the model wrote).
- No `</think>` ever: everything after the start of reasoning is reasoning, as in vLLM (a
  response cut by max_tokens mid-thought stays out of `content`).
- A `<tool_call>` followed (after whitespace) by `<function=` inside reasoning ends it too,
  without `</think>`: Qwen3.5/3.6 do open XML calls so, and vLLM's parser treats it the same
  way. The call, tags included, goes to content for the tool parser; any other `<tool_call>`
  is reasoning text. `tool_call_ends_reasoning=False` turns this off.
- After `</think>` everything is content; a later `<think>` / `</think>` is plain text.
- Newlines: vLLM keeps the template's newlines (`\\n` after `<think>`, before `</think>`, the
  `\\n\\n` after it) in the text it returns, and so do we by default. `strip_newlines=True`
  removes them the way Qwen's chat template does when it renders a past turn: one `\\n` at
  each end of the reasoning, every `\\n` at the start of the content after `</think>`.
- Empty parts are None (the server leaves the field out).
"""

from __future__ import annotations

import re
from typing import ClassVar

from .stream_text import find_first, held_back_len

THINK_START = "<think>"
THINK_END = "</think>"
# Qwen3.5/3.6 may open an XML tool call without closing their thought first.
TOOL_CALL_START = "<tool_call>"
FUNCTION_START = "<function="

_BEFORE, _REASONING, _AFTER = "before", "reasoning", "after"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered chat prompt leaves the assistant turn inside `<think>`.

    Qwen3.5/3.6 with thinking on end the prompt with `<think>\\n`; with thinking off they end it
    with `<think>\\n\\n</think>\\n\\n`, and Qwen3's templates end it before any tag. Only the tail
    is read: earlier assistant turns carry their own closed think blocks.
    """
    return prompt[-64:].rstrip().endswith(THINK_START)


class Qwen3ReasoningParser:
    """`<think>...</think>` splitter for Qwen3, Qwen3-VL and Qwen3.5/3.6 outputs."""

    name: ClassVar[str] = "qwen3"

    def __init__(
        self,
        starts_in_reasoning: bool = False,
        strip_newlines: bool = False,
        tool_call_ends_reasoning: bool = True,
    ) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self.strip_newlines = strip_newlines
        self.tool_call_ends_reasoning = tool_call_ends_reasoning
        self._end_tags = (THINK_END, TOOL_CALL_START) if tool_call_ends_reasoning else (THINK_END,)
        # With strip_newlines a trailing `\n` may be the one just before the end of reasoning.
        newline_tags = tuple("\n" + tag for tag in self._end_tags) if strip_newlines else ()
        self._held_tags = self._end_tags + newline_tags
        ends = [re.escape(THINK_END)]
        if tool_call_ends_reasoning:
            ends.append(re.escape(TOOL_CALL_START) + r"\s*" + re.escape(FUNCTION_START))
        self._end_re = re.compile("|".join(ends))
        self._state = _REASONING if starts_in_reasoning else _BEFORE
        self._held = ""  # a suffix that may still become a tag (or a newline to strip)
        # Nothing consumed yet: a leading `<think>` of a starts_in_reasoning output is a tag.
        self._at_output_start = True
        # The next reasoning / content character is where a template newline would be.
        self._reasoning_fresh = True
        self._content_fresh = False

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside reasoning."""
        return self._state == _REASONING

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; does not touch the streaming state."""
        if self.starts_in_reasoning:
            before = ""
            rest = text[len(THINK_START) :] if text.startswith(THINK_START) else text
        else:
            before, tag, rest = text.partition(THINK_START)
            if not tag:
                return None, text or None
        end = self._end_re.search(rest)
        reasoning = rest if end is None else rest[: end.start()]
        after = "" if end is None else rest[end.start() :]
        if after.startswith(THINK_END):
            after = after[len(THINK_END) :]
            after = after.lstrip("\n") if self.strip_newlines else after
        if self.strip_newlines:
            reasoning = reasoning[1:] if reasoning.startswith("\n") else reasoning
            if end is not None and reasoning.endswith("\n"):
                reasoning = reasoning[:-1]
        return reasoning or None, (before + after) or None

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        """(reasoning delta, content delta) of the next piece of streamed text."""
        reasoning, content = self._consume(self._held + delta)
        return reasoning or None, content or None

    def finish(self) -> tuple[str | None, str | None]:
        """Flush at the end of the stream: a held-back tag prefix was text after all."""
        held, self._held = self._held, ""
        if self._state == _REASONING:
            return held or None, None
        return None, held or None

    def _consume(self, text: str) -> tuple[str, str]:
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state == _BEFORE:
                pos = text.find(THINK_START)
                if pos < 0:
                    keep = held_back_len(text, (THINK_START,))
                    content.append(text[: len(text) - keep])
                    self._held = text[len(text) - keep :]
                    break
                content.append(text[:pos])
                text = text[pos + len(THINK_START) :]
                self._state = _REASONING
                self._at_output_start = False
            elif self._state == _REASONING:
                if self._at_output_start:
                    if THINK_START.startswith(text) and text != THINK_START:
                        self._held = text  # `<thi` at the start: the tag or text, not yet known
                        break
                    if text.startswith(THINK_START):
                        text = text[len(THINK_START) :]
                    self._at_output_start = False
                    continue
                if self.strip_newlines and self._reasoning_fresh:
                    self._reasoning_fresh = False
                    if text.startswith("\n"):
                        text = text[1:]
                    continue
                text = self._reasoning_step(text, reasoning)
            else:
                if self.strip_newlines and self._content_fresh:
                    text = text.lstrip("\n")
                    self._content_fresh = not text
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    def _reasoning_step(self, text: str, reasoning: list[str]) -> str:
        """Emit reasoning up to its end (or up to a possible partial tag); return the rest."""
        found = find_first(text, self._end_tags)
        if found is None:
            keep = held_back_len(text, self._held_tags)
            reasoning.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            return ""
        pos, tag = found
        if tag == TOOL_CALL_START:
            after = text[pos + len(tag) :]
            rest = after.lstrip()
            if not rest.startswith(FUNCTION_START):
                if FUNCTION_START.startswith(rest):  # whitespace or `<func` so far
                    # The newline before the tag too: it goes if the tag is an end.
                    hold = pos - 1 if self.strip_newlines and text[:pos].endswith("\n") else pos
                    reasoning.append(text[:hold])
                    self._held = text[hold:]
                    return ""
                reasoning.append(text[: pos + len(tag)])  # a `<tool_call>` mentioned in thought
                return after
        part = text[:pos]
        if self.strip_newlines and part.endswith("\n"):
            part = part[:-1]
        reasoning.append(part)
        self._state = _AFTER
        if tag == TOOL_CALL_START:
            return text[pos:]  # the call is content: the tool parser must see its tags
        self._content_fresh = True
        return text[pos + len(THINK_END) :]


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}


def get_reasoning_parser(name: str) -> type[Qwen3ReasoningParser]:
    """The parser class registered as `name` (`--reasoning_parser`)."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}") from None
