"""`strict: true` tools under tool_choice "auto": the server guides the output with a structural
tag in its tool-call format, so a call it starts must follow the function's schema, and the
tool parser reads such calls back. Each grammar is run over raw bytes by an xgrammar matcher."""

from __future__ import annotations

import copy
import json
from typing import Any

import openai
import pytest
from test_serve_tools_reasoning import _call

from tensorrt_llm.serve.tool_parsers import get_tool_parser

xgr = pytest.importorskip("xgrammar")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
FREE = {  # not strict: its arguments are any object
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
# (good weather call, weather call with a string for days, a search call with extra arguments)
CALLS = {
    "hermes": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "two"}}'
        "\n</tool_call>",
        '<tool_call>\n{"name": "search", "arguments": {"q": "x", "page": [1, 2]}}\n</tool_call>',
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\ntwo\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n<parameter=page>\n"
        "3\n</parameter>\n</function>\n</tool_call>",
    ),
}


def _matches(structural_tag: str, text: str) -> bool:
    """Whether the grammar takes exactly `text` (one token per byte) and may then end."""
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[256])
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(structural_tag)
    matcher = xgr.GrammarMatcher(grammar)
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.accept_token(256)


def _guide(parser: str, tools: list[dict[str, Any]], **request: Any) -> Any:
    good = CALLS[parser][0]
    response, llm = _call(good, {"tool_call_parser": parser}, tools=tools, **request)
    return response, llm.params[0].guided_decoding


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_strict_calls_follow_their_schema_in_the_server_format(parser: str) -> None:
    response, guide = _guide(parser, [WEATHER, FREE])
    tag = guide.structural_tag
    good, wrong_type, free_call = CALLS[parser]
    assert _matches(tag, "It is sunny, no call needed.")  # text stays free
    assert _matches(tag, "Let me check.\n" + good + "\nDone.")
    assert not _matches(tag, wrong_type)  # days must be an integer
    assert _matches(tag, free_call)  # the non-strict tool's arguments are not checked
    # A call names one of the request's functions (the trigger starts every call).
    assert not _matches(tag, good.replace("get_weather", "get_time"))
    assert _matches(tag, good + "\n" + free_call)  # parallel calls allowed by default
    # The parser reads the guided call back as OpenAI tool_calls.
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert response.choices[0].finish_reason == "tool_calls"
    # The tag is in the server's format: a call of the other format is refused where it
    # starts like one of ours (hermes: any `<tool_call>`), else it is text.
    other = CALLS["hermes" if parser == "qwen3_coder" else "qwen3_coder"][0]
    ours = get_tool_parser(parser).CALL_TRIGGER in other
    assert ours == (parser == "hermes")
    assert _matches(tag, other) != ours


def test_parallel_tool_calls_false_ends_the_output_after_one_call() -> None:
    _, guide = _guide("hermes", [WEATHER], parallel_tool_calls=False)
    good = CALLS["hermes"][0]
    assert _matches(guide.structural_tag, "ok " + good)
    assert not _matches(guide.structural_tag, good + "\n" + good)


def test_only_strict_tools_under_auto_are_guided() -> None:
    loose = copy.deepcopy(WEATHER)
    loose["function"]["strict"] = False
    assert _guide("hermes", [loose, FREE])[1] is None
    assert _guide("hermes", [WEATHER], tool_choice="none")[1] is None
    assert _guide("hermes", [WEATHER], tool_choice="auto")[1].structural_tag
    # "required" and named choices guide the whole output as JSON, strict or not.
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = _call('{"city": "Rome", "days": 1}', {}, tools=[WEATHER], tool_choice=named)
    assert forced[1].params[0].guided_decoding.json == WEATHER["function"]["parameters"]


def test_strict_tools_and_another_constraint_are_refused() -> None:
    with pytest.raises(openai.BadRequestError, match="strict tools .* cannot be combined"):
        _call("{}", {}, tools=[WEATHER], response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="cannot be combined with \\['guided_regex'"):
        _call("{}", {}, tools=[WEATHER], extra_body={"guided_regex": "a+"})
