"""`tool_choice` "required" or a named function, enforced with structured output: the output is
guided to JSON (a named function's arguments; for "required" a list of `{"name",
"parameters"}` calls) and read back into OpenAI `tool_calls`, with no tool-call parser."""

from __future__ import annotations

import json
from typing import Any

from ..guided_decoding_params import GuidedDecodingParams
from .openai_protocol import APIError, ChatCompletionRequest
from .tool_parsers.base import new_call_id

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_function(body: ChatCompletionRequest) -> str | None:
    """The named function `tool_choice` forces (None: not a named choice)."""
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return None
    return choice.function.name


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


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
        return GuidedDecodingParams(json=_parameters(match[0]))
    if body.tool_choice != "required" or not tools:
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.function.name]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return GuidedDecodingParams(json=schema)


def forced_calls(text: str, name: str | None) -> list[dict[str, Any]] | None:
    """OpenAI `tool_calls` from a guided output (None: it did not close, e.g. cut by length).

    `name`: the forced function (the text is its arguments), or None for "required" (the text
    is a list of calls)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    pairs = [(name, value)] if name is not None else [
        (c.get("name"), c.get("parameters")) for c in value if isinstance(c, dict)
    ] if isinstance(value, list) else []  # fmt: skip
    calls = []
    for fn, args in pairs:
        if not isinstance(fn, str) or not isinstance(args, dict):
            return None
        arguments = json.dumps(args, ensure_ascii=False)
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": fn, "arguments": arguments}})  # fmt: skip
    return calls or None
