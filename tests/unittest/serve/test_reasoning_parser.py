"""`--reasoning_parser qwen3`: fixed outputs split whole and streamed in every chunking."""

from __future__ import annotations

import pytest
from parser_chunks import CHUNKINGS, chunks

from tensorrt_llm.serve.reasoning_parser import (
    REASONING_PARSERS,
    Qwen3ReasoningParser,
    get_reasoning_parser,
    prompt_opens_reasoning,
)

# (id, text, starts_in_reasoning, strip_newlines, reasoning, content)
CASES = [
    ("qwen3", "<think>\nPlan.\n</think>\n\nHello!", False, False, "\nPlan.\n", "\n\nHello!"),
    ("qwen3-strip", "<think>\nPlan.\n</think>\n\nHello!", False, True, "Plan.", "Hello!"),
    ("qwen3.5", "Plan.\n</think>\n\nHello!", True, False, "Plan.\n", "\n\nHello!"),
    ("qwen3.5-strip", "\nPlan.\n</think>\n\nHello!", True, True, "Plan.", "Hello!"),
    ("qwen3.5-own-tag", "<think>\nabc\n</think>\n\nxyz", True, False, "\nabc\n", "\n\nxyz"),
    ("qwen3.5-own-tag-strip", "<think>\nabc\n</think>\n\nxyz", True, True, "abc", "xyz"),
    ("no-tags", "Just an answer.", False, False, None, "Just an answer."),
    ("no-tags-strip", "\nJust an answer.\n", False, True, None, "\nJust an answer.\n"),
    ("truncated", "still thinking about it <", True, False, "still thinking about it <", None),
    ("ends-in-end-tag", "thinking</thi", True, False, "thinking</thi", None),
    ("ends-in-start-tag", "Answer <thi", False, False, None, "Answer <thi"),
    ("ends-in-leading-tag", "<thin", True, False, "<thin", None),
    ("never-closed", "<think>\nhmm, what if", False, False, "\nhmm, what if", None),
    ("never-closed-strip", "\nhmm\n", True, True, "hmm\n", None),
    ("content-before", "Hi <think>r</think> bye", False, False, "r", "Hi  bye"),
    ("empty-reasoning", "<think>\n\n</think>\n\nHello", False, False, "\n\n", "\n\nHello"),
    ("empty-reasoning-strip", "<think>\n\n</think>\n\nHello", False, True, None, "Hello"),
    ("empty-content", "done thinking</think>", True, False, "done thinking", None),
    ("only-newlines-after-strip", "r\n</think>\n\n", True, True, "r", None),
    ("second-end-is-text", "x</think>y</think>z", True, False, "x", "y</think>z"),
    ("mid-start-is-text", "a<think>b</think>c", True, False, "a<think>b", "c"),
    ("second-start-is-text", "<think>a</think>b<think>c", False, False, "a", "b<think>c"),
    # Nothing here closes the reasoning, so all of it is reasoning.
    (
        "near-miss-tags",
        "a < b </thinking> <think2> </ think>",
        True,
        False,
        "a < b </thinking> <think2> </ think>",
        None,
    ),
    ("many-angles", "<<</</t</think>>", True, False, "<<</</t", ">"),
    ("newline-before-tag-kept", "a\n\n</think>b", True, True, "a\n", "b"),
    ("unicode", "思考中…🙂\n</think>\n\n答案：42 ✓", True, False, "思考中…🙂\n", "\n\n答案：42 ✓"),
    ("unicode-strip", "<think>\nΔ≈π 🙂\n</think>\n\nΩ", False, True, "Δ≈π 🙂", "Ω"),
    (
        "tool-call-ends-reasoning",
        "Need data.\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
        True,
        False,
        "Need data.\n",
        "<tool_call>\n<function=f>\n</function>\n</tool_call>",
    ),
    (
        "tool-call-ends-reasoning-strip",
        "\nNeed data.\n<tool_call><function=f>",
        True,
        True,
        "Need data.",
        "<tool_call><function=f>",
    ),
    (
        "tool-call-then-end-tag-is-content",
        "a<tool_call> \t<function=f></tool_call></think>b",
        True,
        False,
        "a",
        "<tool_call> \t<function=f></tool_call></think>b",
    ),
    (
        "tool-call-mentioned",
        "use <tool_call> or <tool_call>{json}\n</think>\n\nOK",
        True,
        False,
        "use <tool_call> or <tool_call>{json}\n",
        "\n\nOK",
    ),
    (
        "tool-call-mention-then-real",
        "x<tool_call><tool_call>\n<function=g>",
        True,
        False,
        "x<tool_call>",
        "<tool_call>\n<function=g>",
    ),
    ("tool-call-denied-strip", "a\n<tool_call>x", True, True, "a\n<tool_call>x", None),
    ("tool-call-unconfirmed", "think <tool_call>\n", True, False, "think <tool_call>\n", None),
    ("tool-call-cut", "think <tool_call>\n<func", True, False, "think <tool_call>\n<func", None),
    (
        "tool-call-after-end",
        "r</think>\n<tool_call>\n<function=f>",
        True,
        False,
        "r",
        "\n<tool_call>\n<function=f>",
    ),
    ("empty", "", False, False, None, None),
    ("empty-in-reasoning", "", True, True, None, None),
]


def _stream(parser: Qwen3ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        assert r != "" and c != "", "empty parts are None"
        # A tag fragment sent as text could not be taken back when the tag completes, so the
        # equality with parse() also shows that none was sent.
        if r is not None:
            reasoning.append(r)
        if c is not None:
            content.append(c)
    r, c = parser.finish()
    reasoning += [r] if r else []
    content += [c] if c else []
    return "".join(reasoning) or None, "".join(content) or None


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parse(case: tuple) -> None:
    _, text, starts, strip, reasoning, content = case
    parser = Qwen3ReasoningParser(starts_in_reasoning=starts, strip_newlines=strip)
    assert parser.parse(text) == (reasoning, content)


@pytest.mark.parametrize("how", CHUNKINGS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stream_equals_parse(case: tuple, how: str) -> None:
    _, text, starts, strip, reasoning, content = case
    parser = Qwen3ReasoningParser(starts_in_reasoning=starts, strip_newlines=strip)
    assert _stream(parser, chunks(text, how)) == (reasoning, content)


@pytest.mark.parametrize("how", CHUNKINGS)
def test_tool_call_ends_reasoning_off(how: str) -> None:
    text = "a\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    parser = Qwen3ReasoningParser(starts_in_reasoning=True, tool_call_ends_reasoning=False)
    assert parser.parse(text) == (text, None)
    assert _stream(parser, chunks(text, how)) == (text, None)


def test_partial_end_tag_is_held_back() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("abc</") == ("abc", None)
    assert parser.in_reasoning
    assert parser.feed("think") == (None, None)
    assert parser.feed(">") == (None, None)
    assert not parser.in_reasoning
    assert parser.feed("x") == (None, "x")
    assert parser.finish() == (None, None)


def test_partial_tag_that_is_text_comes_back() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("a </th") == ("a ", None)
    assert parser.feed("ings") == ("</things", None)
    parser = Qwen3ReasoningParser()
    assert parser.feed("x <thi") == (None, "x ")
    assert parser.finish() == (None, "<thi")


def test_leading_tag_in_reasoning_is_held_then_dropped() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("<th") == (None, None)
    assert parser.feed("ink>") == (None, None)
    assert parser.feed("r") == ("r", None)


def test_strip_holds_newline_before_end_tag() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=True, strip_newlines=True)
    assert parser.feed("\nab\n") == ("ab", None)
    assert parser.feed("</think>\n") == (None, None)
    assert parser.feed("\nc\n") == (None, "c\n")


def test_parse_does_not_touch_stream_state() -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("a") == ("a", None)
    assert parser.parse("x</think>y") == ("x", "y")
    assert parser.in_reasoning
    assert parser.feed("</think>b") == (None, "b")


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
        ("<think>\nold\n</think>\n\nold answer<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think>\nold\n</think>\n\nx<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
    ],
)
def test_prompt_opens_reasoning(prompt: str, opens: bool) -> None:
    assert prompt_opens_reasoning(prompt) is opens


def test_registry() -> None:
    assert REASONING_PARSERS == {"qwen3": Qwen3ReasoningParser}
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="'deepseek_r1'.*known parsers: qwen3"):
        get_reasoning_parser("deepseek_r1")
