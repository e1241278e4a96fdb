"""`ForcedCallStream`: the guided JSON of forced tool calls read as it is generated.

The stream must send a call's header before its arguments are complete and its arguments in
fragments whose concatenation equals the whole response's `arguments`, in every chunking."""

from __future__ import annotations

import json
import random

import pytest

from tensorrt_llm.serve.forced_tools import ForcedCallStream, forced_calls

# Braces, brackets, quotes and backslashes inside strings must not move the scanner's depth.
TWO_CALLS = (
    '[ {"name": "get_weather", "parameters": {"city": "Pa\\"ris} ]", "tags": ["a{", "\\\\"],'
    ' "days": {"n": 2}}},\n {"name":"get_time","parameters":{}} ]'
)
ARGS = ['{"city": "Pa\\"ris} ]", "tags": ["a{", "\\\\"], "days": {"n": 2}}', "{}"]


def _stream(text: str, name: str | None, cuts: list[int]) -> tuple[list[dict], ForcedCallStream]:
    stream, deltas = ForcedCallStream(name), []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        deltas += stream.feed(text[a:b])
    return deltas + stream.finish(), stream


def _joined(deltas: list[dict]) -> dict[int, dict[str, str]]:
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"name": "", "arguments": "", "id": ""})
        call["id"] += d.get("id", "")
        call["name"] += d["function"].get("name", "")
        call["arguments"] += d["function"].get("arguments", "")
    return calls


@pytest.mark.parametrize("seed", range(20))
def test_required_list_streams_headers_then_fragments_in_any_chunking(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TWO_CALLS)), rng.randint(1, 40)))
    deltas, stream = _stream(TWO_CALLS, None, cuts)
    calls = _joined(deltas)
    assert [calls[i]["name"] for i in (0, 1)] == ["get_weather", "get_time"]
    assert [calls[i]["arguments"] for i in (0, 1)] == ARGS
    assert all(calls[i]["id"].startswith("call_") for i in (0, 1)) and stream.closed
    assert json.loads(ARGS[0])["tags"] == ["a{", "\\"]  # the fixture is valid JSON
    whole = forced_calls(TWO_CALLS, None)
    assert [c["function"]["arguments"] for c in whole] == ARGS  # whole == streamed


def test_header_goes_out_before_the_arguments_complete() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}]'
    stream = ForcedCallStream(None)
    first = stream.feed(text[: text.index('"Rome"') + 3])
    assert first[0]["function"]["name"] == "get_weather" and first[0]["index"] == 0
    assert first[-1]["function"]["arguments"] == '{"city": "Ro'
    rest = stream.feed(text[len(text.split('"Rome"')[0]) + 3 :])
    assert "".join(d["function"]["arguments"] for d in rest) == 'me", "days": 3}'
    assert all("id" not in d for d in rest)


def test_named_choice_streams_the_whole_object_without_outer_whitespace() -> None:
    text = ' \n{"city": "Rome" ,\n "x": [1, {"y": "}"}]} \n '
    deltas, stream = _stream(text, "get_weather", list(range(1, len(text))))
    calls = _joined(deltas)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == text.strip() and stream.closed
    (whole,) = forced_calls(text, "get_weather")
    assert whole["function"] == {"name": "get_weather", "arguments": text.strip()}


def test_cut_or_malformed_outputs_are_no_calls_when_whole() -> None:
    cut = TWO_CALLS[: TWO_CALLS.index("get_time")]
    assert forced_calls(cut, None) is None  # cut by max_tokens: the list never closed
    deltas, stream = _stream(cut, None, [10, 50])
    assert _joined(deltas)[0]["arguments"] == ARGS[0] and not stream.closed  # streamed as is
    assert forced_calls('[{"parameters": {}, "name": "f"}]', None) is None  # not the schema
    assert forced_calls("[]", None) is None
    assert forced_calls('{"a": 1', "f") is None
