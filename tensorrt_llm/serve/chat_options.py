"""Per-request chat options of `trtllm-serve`: tools and `chat_template_kwargs` for the chat
template, and how the outputs are parsed (`--reasoning_parser`, `--tool_call_parser`)."""

from __future__ import annotations

import logging
from typing import Any

from ..inputs.chat_tokenize import template_variables
from .choice_parsers import ChoiceParsing
from .forced_tools import forced_function
from .openai_protocol import APIError, ChatCompletionRequest
from .reasoning_parser import Qwen3ReasoningParser, get_reasoning_parser
from .tool_parsers import ToolParser, default_tool_parser, get_tool_parser

logger = logging.getLogger(__name__)


class ChatParsers:
    """The server's parser classes, from its flags (an unknown name fails at startup)."""

    def __init__(self, llm: Any, args: Any, model_name: str) -> None:
        reasoning = getattr(args, "reasoning_parser", None)
        self.reasoning: type[Qwen3ReasoningParser] | None = (
            get_reasoning_parser(reasoning) if reasoning else None
        )
        name = getattr(args, "tool_call_parser", None)
        if not name:
            name = default_tool_parser(_model_type(llm) or model_name)
        self.tool_parser_name = name
        self.tool_parser: type[ToolParser] = get_tool_parser(name)
        logger.info(
            "chat output parsing: reasoning parser %s, tool call parser %s",
            reasoning or "off",
            name,
        )

    def for_request(self, body: ChatCompletionRequest) -> ChoiceParsing:
        """How this request's outputs are parsed (a forced tool choice: read as the guided
        JSON of its calls)."""
        tools = tool_dicts(body)
        choice = body.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise APIError(
                400, "tool_choice is set but the request has no tools", param="tool_choice"
            )
        if tools and (choice == "required" or not isinstance(choice, str | None)):
            # Enforced by structured output (forced_tools.py): the output is the call's JSON,
            # read back without a tool parser or a reasoning split.
            return ChoiceParsing(forced=True, forced_name=forced_function(body))
        parse_tools = bool(tools) and choice != "none"
        return ChoiceParsing(
            reasoning=self.reasoning,
            tool_parser=self.tool_parser if parse_tools else None,
            tools=tools if parse_tools else None,
            single_call=body.parallel_tool_calls is False,
        )


def tool_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template and the parsers read them."""
    if not body.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def template_kwargs(
    body: ChatCompletionRequest, forced: bool = False, template_renders_tools: bool = True
) -> dict[str, Any] | None:
    """`chat_template_kwargs` plus the tools (omitted with tool_choice "none", so the model is
    not told about tools it may not call).

    forced: the call is enforced by structured output (tool_choice "required" or named); then
    a template without tool support gets no tools (the schema still makes the call). Under
    "auto" they are passed anyway, and a template that cannot render them is a 400
    (chat_tokenize): the model would never know it may call them."""
    kwargs = dict(body.chat_template_kwargs or {})
    tools = tool_dicts(body)
    if forced and not template_renders_tools:
        tools = None
    if tools and body.tool_choice != "none":
        if "tools" in kwargs:
            raise APIError(
                400, "tools given both as a field and in chat_template_kwargs; use the field",
                param="chat_template_kwargs",
            )  # fmt: skip
        kwargs["tools"] = tools
    return kwargs or None


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template reads `tools` (True when there is no single template to
    look at: the render then decides)."""
    template = getattr(tokenizer, "chat_template", None)
    return not isinstance(template, str) or "tools" in template_variables(template)


def _model_type(llm: Any) -> str | None:
    config = getattr(getattr(llm, "input_processor", None), "config", None)
    model_type = getattr(config, "model_type", None)
    return model_type if isinstance(model_type, str) else None
