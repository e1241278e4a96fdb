"""`strict: true` function tools under `tool_choice` "auto": calls that follow their schemas.

OpenAI's `strict` promises that a call's arguments match the function's JSON schema. Under
"required" or a named choice the whole output is guided already (forced_tools.py). Under "auto"
the model may answer in text or call tools, so the output is guided by an xgrammar structural
tag instead: free text, except that once the model writes the start of a call in the server's
tool-call format (`--tool_call_parser`), it must name one of the request's functions and give
arguments its schema accepts, then close the call. The tool parser reads such calls back as
usual.

Non-strict tools of the same request keep OpenAI's meaning (arguments not checked): their calls
take any JSON object. The free text is not otherwise constrained, so reasoning, content and the
end of the output are the model's; a call inside the reasoning must be well-formed too.
"""

from __future__ import annotations

import json
from typing import Any

from ..guided_decoding_params import GuidedDecodingParams
from .forced_tools import ANY_OBJECT, tool_parameters
from .openai_protocol import ChatCompletionRequest
from .tool_parsers import ToolParser


def has_strict_tools(body: ChatCompletionRequest) -> bool:
    """Whether the request's calls must follow schemas by `strict` under "auto"."""
    tools = body.tools or []
    auto = body.tool_choice is None or body.tool_choice == "auto"
    return auto and any(tool.function.strict for tool in tools)


def strict_tool_guide(
    body: ChatCompletionRequest, parser: type[ToolParser]
) -> GuidedDecodingParams:
    """The structural tag that holds the `strict` tools of a request with some under "auto"
    (`has_strict_tools`) to their schemas in `parser`'s format."""
    tags = []
    for tool in body.tools or []:
        function = tool.function
        schema = tool_parameters(tool) if function.strict else ANY_OBJECT
        content: dict[str, Any] = {"type": "json_schema", "json_schema": schema}
        if parser.ARGUMENTS_STYLE != "json":
            content["style"] = parser.ARGUMENTS_STYLE
        tags.append(
            {
                "type": "tag",
                "begin": parser.call_begin(function.name),
                "content": content,
                "end": parser.CALL_END,
            }
        )
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [parser.CALL_TRIGGER],
            "tags": tags,
            # parallel_tool_calls false: the output ends after its first call.
            "stop_after_first": body.parallel_tool_calls is False,
        },
    }
    return GuidedDecodingParams(structural_tag=json.dumps(tag))
