"""Fixed model outputs for the tool-call parser tests, with what each must yield.

Each case is (id, text, expected content, expected [(function name, arguments JSON)]).
"""

from __future__ import annotations

import json
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "configure",
            "parameters": {
                "type": "object",
                "properties": {
                    "enabled": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "options": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                    "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "anything": {"description": "no type"},
                },
            },
        },
    },
]


def hermes_call(name: str, args: Any) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        + "\n</tool_call>"
    )


def xml_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


HERMES_CASES = [
    (
        "content-before",
        "Let me check.\n" + hermes_call("get_weather", {"city": "Paris", "days": 3}),
        "Let me check.",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "two-calls",
        hermes_call("get_weather", {"city": "Oslo"})
        + "\n"
        + hermes_call("configure", {"ratio": 0.5}),
        None,
        [("get_weather", '{"city": "Oslo"}'), ("configure", '{"ratio": 0.5}')],
    ),
    (
        "content-after",
        "A\n" + hermes_call("get_weather", {}) + "\nDone.",
        "A\nDone.",
        [("get_weather", "{}")],
    ),
    (
        "content-between",
        "A\n" + hermes_call("f", {}) + "\nB\n" + hermes_call("g", {}) + "\n",
        "A\nB",
        [("f", "{}"), ("g", "{}")],
    ),
    (
        "bad-json",
        'x <tool_call>\n{"name": "f", "arguments": {bad}}\n</tool_call>',
        'x <tool_call>\n{"name": "f", "arguments": {bad}}\n</tool_call>',
        [],
    ),
    (
        "bad-then-good",
        "<tool_call>\n{oops\n</tool_call>\n" + hermes_call("f", {"a": 1}),
        "<tool_call>\n{oops\n</tool_call>",
        [("f", '{"a": 1}')],
    ),
    (
        "good-then-bad",
        hermes_call("f", {"a": 1}) + "\n<tool_call>[1, 2]</tool_call>",
        "<tool_call>[1, 2]</tool_call>",
        [("f", '{"a": 1}')],
    ),
    (
        "nameless",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    (
        "arguments-not-object",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),
    (
        "nested-open-tag",
        '<tool_call>oops <tool_call>{"name": "f", "arguments": {}}</tool_call>',
        "<tool_call>oops",
        [("f", "{}")],
    ),
    (
        "unterminated-valid",
        'Sure: <tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n',
        "Sure:",
        [("f", '{"q": "x"}')],
    ),
    (
        "unterminated-invalid",
        '<tool_call>\n{"name": "f", "argu',
        '<tool_call>\n{"name": "f", "argu',
        [],
    ),
    (
        "nan-is-no-json",
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        [],
    ),
    ("ends-in-open-tag", "Hello <tool_", "Hello <tool_", []),
    ("near-miss-tag", "a <tool_calls> b <tool call>", "a <tool_calls> b <tool call>", []),
    ("no-calls-verbatim", "  plain text \n\n", "  plain text \n\n", []),
    (
        "unicode",
        "Voilà 🙂\n" + hermes_call("get_weather", {"city": "Zürich 東京"}),
        "Voilà 🙂",
        [("get_weather", '{"city": "Zürich 東京"}')],
    ),
    (
        "unknown-function-kept",
        hermes_call("not_a_tool", {"x": True}),
        None,
        [("not_a_tool", '{"x": true}')],
    ),
    (
        "string-arguments",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>',
        None,
        [("f", '{"a": [1, 2]}')],
    ),
    (
        "parameters-key-and-no-arguments",
        '<tool_call>{"name": "f", "parameters": {"k": null}}</tool_call>'
        '<tool_call>{"name": "g"}</tool_call>',
        None,
        [("f", '{"k": null}'), ("g", "{}")],
    ),
    (
        "reserialised",
        '<tool_call>{"name":"f","arguments":{"a":1,"b":{"c":"d"}}}</tool_call>',
        None,
        [("f", '{"a": 1, "b": {"c": "d"}}')],
    ),
    ("empty", "", None, []),
]

QWEN3_CODER_CASES = [
    (
        "content-before",
        "Sure.\n" + xml_call("get_weather", ("city", "Paris"), ("days", "3"), ("unit", "c")),
        "Sure.",
        [("get_weather", '{"city": "Paris", "days": 3, "unit": "c"}')],
    ),
    (
        "every-type",
        xml_call(
            "configure",
            ("enabled", "True"),
            ("ratio", "0.25"),
            ("tags", '["a", "b"]'),
            ("options", '{"depth": 2, "mode": null}'),
            ("note", "null"),
            ("limit", "7"),
            ("anything", "kept as text"),
        ),
        None,
        [
            (
                "configure",
                '{"enabled": true, "ratio": 0.25, "tags": ["a", "b"], '
                '"options": {"depth": 2, "mode": null}, "note": null, "limit": 7, '
                '"anything": "kept as text"}',
            )
        ],
    ),
    (
        "string-kept-exactly",
        xml_call("get_weather", ("city", "  two\n\nlines </para x < y  ")),
        None,
        [("get_weather", json.dumps({"city": "  two\n\nlines </para x < y  "}))],
    ),
    (
        "type-failures-stay-strings",
        xml_call(
            "configure",
            ("enabled", "yes"),
            ("ratio", "nan"),
            ("tags", "not json"),
            ("limit", "1.5"),
        ),
        None,
        [("configure", '{"enabled": "yes", "ratio": "nan", "tags": "not json", "limit": "1.5"}')],
    ),
    (
        "python-literal-object",
        xml_call("configure", ("options", "{'a': True, 'b': None}"), ("ratio", "2")),
        None,
        [("configure", '{"options": {"a": true, "b": null}, "ratio": 2}')],
    ),
    (
        "unknown-param-and-function",
        xml_call("get_weather", ("days", "4"), ("extra", "5"))
        + "\n"
        + xml_call("not_a_tool", ("n", "5")),
        None,
        [("get_weather", '{"days": 4, "extra": "5"}'), ("not_a_tool", '{"n": "5"}')],
    ),
    (
        "two-calls-content-around",
        "A\n" + xml_call("f", ("x", "1")) + "\n" + xml_call("g") + "\nB",
        "A\nB",
        [("f", '{"x": "1"}'), ("g", "{}")],
    ),
    (
        "two-functions-one-block",
        "<tool_call>\n<function=f>\n</function>\n<function=g>\n<parameter=y>\nz\n</parameter>\n"
        "</function>\n</tool_call>",
        None,
        [("f", "{}"), ("g", '{"y": "z"}')],
    ),
    (
        "missing-parameter-ends",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n"
        "</function>\n</tool_call>",
        None,
        [("get_weather", '{"city": "Rome", "days": 2}')],
    ),
    (
        "text-between-tags-ignored",
        "<tool_call><function=f> junk <parameter=a>v</parameter> more </function></tool_call>",
        None,
        [("f", '{"a": "v"}')],
    ),
    (
        "not-a-function",
        "x\n<tool_call>\nnot a function\n</tool_call>",
        "x\n<tool_call>\nnot a function\n</tool_call>",
        [],
    ),
    (
        "bad-name",
        "<tool_call>\n<function=bad\nname>\n</function>\n</tool_call>",
        "<tool_call>\n<function=bad\nname>\n</function>\n</tool_call>",
        [],
    ),
    ("empty-name", "<tool_call><function=></function>", "<tool_call><function=></function>", []),
    ("bare-function-is-content", "<function=f>\n</function>", "<function=f>\n</function>", []),
    (
        "truncated-in-value",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        None,
        [("get_weather", '{"city": "Par"}')],
    ),
    (
        "truncated-in-param-name",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n<parameter=da",
        None,
        [("get_weather", '{"city": "X"}')],
    ),
    (
        "truncated-in-end-tag",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n5\n</param",
        None,
        [("get_weather", '{"days": 5}')],
    ),
    (
        "truncated-after-function",
        "<tool_call>\n<function=f>\n</function>\n</tool_",
        None,
        [("f", "{}")],
    ),
    (
        "truncated-in-name",
        "ok <tool_call>\n<function=get_wea",
        "ok <tool_call>\n<function=get_wea",
        [],
    ),
    ("truncated-in-open", "ok <tool_call>\n<func", "ok <tool_call>\n<func", []),
    ("ends-in-open-tag", "text <tool_c", "text <tool_c", []),
    (
        "unicode",
        "好的 🙂\n" + xml_call("get_weather", ("city", "Zürich 東京"), ("ünït", "ü")),
        "好的 🙂",
        [("get_weather", '{"city": "Zürich 東京", "ünït": "ü"}')],
    ),
    ("empty", "", None, []),
]
