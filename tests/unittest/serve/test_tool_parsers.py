"""`--tool_call_parser hermes|qwen3_coder`: fixed outputs extracted whole and streamed.

Every case is checked twice: `extract` against the expected content and calls, and a stream of
the same text (whole, one character at a time, random chunk sizes) against `extract`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from parser_chunks import CHUNKINGS, chunks
from tool_parser_cases import HERMES_CASES, QWEN3_CODER_CASES, TOOLS, hermes_call, xml_call

from tensorrt_llm.serve.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    HermesToolParser,
    Qwen3CoderToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamDelta,
    default_tool_parser,
    get_tool_parser,
)
from tensorrt_llm.serve.tool_parsers.base import TOOL_CALL_START
from tensorrt_llm.serve.tool_parsers.param_types import convert_param_value

CALL_ID = re.compile(r"call_[0-9a-f]{24}")

PARSERS = [(HermesToolParser, c) for c in HERMES_CASES] + [
    (Qwen3CoderToolParser, c) for c in QWEN3_CODER_CASES
]
IDS = [f"{cls.name}-{case[0]}" for cls, case in PARSERS]


def _stream(parser: ToolParser, pieces: list[str]) -> ExtractedToolCalls:
    """Feed the pieces, check the OpenAI delta rules, and assemble what the client would."""
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas if d.content is not None)
    calls: list[ToolCall] = []
    for delta in deltas:
        assert delta.content != ""
        assert len({d.index for d in delta.tool_calls}) == len(delta.tool_calls)
        for part in delta.tool_calls:
            if part.index == len(calls):  # a new call: its first delta names it
                assert part.id is not None and CALL_ID.fullmatch(part.id)
                assert part.name is not None
                assert part.to_openai()["type"] == "function"
                calls.append(ToolCall(part.id, part.name, ""))
            else:
                assert part.index == len(calls) - 1, "calls arrive one after another"
                assert part.id is None and part.name is None
            calls[part.index].arguments_json += part.arguments or ""
    return ExtractedToolCalls(content or None, calls)


def _summary(result: ExtractedToolCalls) -> tuple[str | None, list[tuple[str, str]]]:
    return result.content, [(c.name, c.arguments_json) for c in result.calls]


@pytest.mark.parametrize(("cls", "case"), PARSERS, ids=IDS)
def test_extract(cls: type[ToolParser], case: tuple) -> None:
    _, text, content, calls = case
    result = cls.extract(text, TOOLS)
    assert _summary(result) == (content, calls)
    assert result.tools_called is bool(calls)
    for call in result.calls:
        assert CALL_ID.fullmatch(call.id)
        json.loads(call.arguments_json)  # always valid JSON
    assert len({c.id for c in result.calls}) == len(result.calls)


@pytest.mark.parametrize("how", CHUNKINGS)
@pytest.mark.parametrize(("cls", "case"), PARSERS, ids=IDS)
def test_stream_equals_extract(cls: type[ToolParser], case: tuple, how: str) -> None:
    _, text, content, calls = case
    assert _summary(_stream(cls(TOOLS), chunks(text, how))) == (content, calls)


def test_hermes_call_arrives_whole_at_its_end_tag() -> None:
    parser = HermesToolParser(TOOLS)
    assert parser.feed("Hi <tool") == ToolStreamDelta(content="Hi")
    assert parser.feed('_call>{"name": "f", "arguments": {}}</tool_c').is_empty
    out = parser.feed("all>\nbye")
    assert out.content == " bye"  # the space before the call separates: its newline goes
    assert len(out.tool_calls) == 1
    assert (out.tool_calls[0].name, out.tool_calls[0].arguments) == ("f", "{}")
    assert parser.finish().is_empty


def test_qwen3_coder_streams_header_then_each_parameter() -> None:
    parser = Qwen3CoderToolParser(TOOLS)
    assert parser.feed("<tool_call>\n<function=get_weather").is_empty
    header = parser.feed(">\n<parameter=days>\n1")
    [first] = header.tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "{")
    assert first.to_openai() == {
        "index": 0,
        "id": first.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{"},
    }
    assert parser.feed("2\n").is_empty  # the value is typed only once it is complete
    [days] = parser.feed("</parameter>\n").tool_calls
    assert days == ToolCallDelta(0, arguments='"days": 12')
    assert days.to_openai() == {"index": 0, "function": {"arguments": '"days": 12'}}
    [end] = parser.feed("</function>\n</tool_call>").tool_calls
    assert end.arguments == "}"
    assert parser.finish().is_empty


def test_partial_open_tag_is_held_back() -> None:
    for cls in (HermesToolParser, Qwen3CoderToolParser):
        parser = cls()
        assert parser.feed("a <tool_ca").content == "a"
        assert parser.feed("t>").content == " <tool_cat>"
        assert parser.feed(" <").content is None
        assert parser.finish().content == " <"
        parser = cls()
        assert all(parser.feed(char).is_empty for char in TOOL_CALL_START[:-1])


def test_without_tools_values_are_strings() -> None:
    result = Qwen3CoderToolParser.extract(xml_call("get_weather", ("days", "3")), None)
    assert result.calls[0].arguments_json == '{"days": "3"}'
    assert (
        HermesToolParser.extract(hermes_call("f", {"a": 1})).calls[0].arguments_json == '{"a": 1}'
    )


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("x y ", {"type": "string"}, "x y "),
        ("null", {"type": "string"}, "null"),
        ("NULL", {"type": "integer"}, None),
        ("-12", {"type": "integer"}, -12),
        (" 7 ", {"type": "integer"}, 7),
        ("7.0", {"type": "integer"}, "7.0"),
        ("3", {"type": "number"}, 3),
        ("3.0", {"type": "number"}, 3.0),
        ("-1e3", {"type": "number"}, -1000.0),
        ("inf", {"type": "number"}, "inf"),
        ("FALSE", {"type": "boolean"}, False),
        ("1", {"type": "boolean"}, "1"),
        ('[1, {"a": 2}]', {"type": "array"}, [1, {"a": 2}]),
        ("(1, 2)", {"type": "array"}, "(1, 2)"),
        ('{"a": NaN}', {"type": "object"}, '{"a": NaN}'),
        ("[1]", {"type": "object"}, "[1]"),
        ("{1, 2}", {"type": "object"}, "{1, 2}"),
        ("5", {"type": ["integer", "string"]}, 5),
        ("five", {"type": ["integer", "string"]}, "five"),
        ("8", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, 8),
        ("[2]", {"type": "tuple"}, [2]),
        ("not json", {"type": "tuple"}, "not json"),
        ("5", {"enum": ["5"]}, "5"),
        ("5", None, "5"),
    ],
)
def test_convert_param_value(text: str, schema: Any, value: Any) -> None:
    converted = convert_param_value(text, schema)
    assert converted == value and type(converted) is type(value)


@pytest.mark.parametrize(
    ("model", "parser"),
    [
        ("qwen3_5", "qwen3_coder"),
        ("qwen3_5_moe", "qwen3_coder"),
        ("Qwen3_5MoeForConditionalGeneration", "qwen3_coder"),
        ("Qwen3_5ForCausalLM", "qwen3_coder"),
        ("Qwen/Qwen3.6-35B-A3B", "qwen3_coder"),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_coder"),
        ("qwen3_coder", "qwen3_coder"),
        ("qwen2", "hermes"),
        ("Qwen2_5_VLForConditionalGeneration", "hermes"),
        ("Qwen2.5-Coder-7B-Instruct", "hermes"),
        ("qwen3", "hermes"),
        ("Qwen3MoeForCausalLM", "hermes"),
        ("qwen3_vl", "hermes"),
        ("Qwen3VLMoeForConditionalGeneration", "hermes"),
        ("llama", "hermes"),
    ],
)
def test_default_tool_parser(model: str, parser: str) -> None:
    assert default_tool_parser(model) == parser


def test_registry() -> None:
    assert TOOL_PARSERS == {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser}
    assert get_tool_parser("qwen3_coder") is Qwen3CoderToolParser
    with pytest.raises(ValueError, match="'mistral'.*known parsers: hermes, qwen3_coder"):
        get_tool_parser("mistral")


def test_results_are_json_friendly() -> None:
    result = HermesToolParser.extract(hermes_call("f", {"a": "ü"}))
    call = result.calls[0].to_openai()
    assert call == {
        "id": call["id"],
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": "ü"}'},
    }
    json.dumps(call)
