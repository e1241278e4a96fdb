"""Tool calls and reasoning through the HTTP server, with the `openai` client's types: a scripted
LLM stand-in emits fixed texts (a random model never writes a tool call), the server parses
them with `--tool_call_parser` / `--reasoning_parser`, streaming and not."""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from tensorrt_llm.serve.app import build_app

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
HERMES = (
    "<think>\nThe user wants weather.\n</think>\n\nLet me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
CODER = (
    "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


class _Result:
    """A GenerationResult stand-in that streams `text` in small pieces."""

    def __init__(self, text: str, streaming: bool) -> None:
        self.text, self.streaming = text, streaming
        self.prompt_token_ids = [1, 2, 3]
        self.error = self.error_code = None
        self.metrics = None  # no engine behind it: no engine stamps
        self.finished = False
        self.outputs = [self._out(text if not streaming else "", None)]

    @staticmethod
    def _out(text: str, reason: str | None) -> Any:
        return SimpleNamespace(
            text=text, token_ids=list(range(len(text))), finish_reason=reason,
            finished=reason is not None,
        )  # fmt: skip

    def __aiter__(self) -> Any:
        return self._snapshots()

    async def _snapshots(self) -> Any:
        cuts = list(range(0, len(self.text), 5)) + [len(self.text)] if self.streaming else []
        for end in cuts[1:]:
            self.outputs = [self._out(self.text[:end], None)]
            yield self
        self.outputs = [self._out(self.text, "stop")]
        self.finished = True
        yield self

    def abort(self) -> None:
        self.finished = True


class _ScriptedLLM:
    tokenizer = SimpleNamespace(decode=lambda ids: "<|im_start|>assistant\n")
    max_seq_len = 4096

    def __init__(self, text: str) -> None:
        self.text = text
        self.prompts: list[Any] = []
        self.params: list[Any] = []

    def generate_async(self, prompt: Any, sampling_params: Any = None, **kw: Any) -> _Result:
        self.prompts.append(prompt)
        self.params.append(sampling_params)
        return _Result(self.text, kw.get("streaming", False))

    def shutdown(self) -> None:
        pass


def _call(text: str, flags: dict[str, Any], **request: Any) -> tuple[Any, _ScriptedLLM]:
    llm = _ScriptedLLM(text)
    app = build_app(llm, Namespace(served_model_name="m", **flags))

    async def run() -> Any:
        transport = httpx.ASGITransport(app=app)
        http = httpx.AsyncClient(transport=transport, base_url="http://t/v1")
        client = openai.AsyncOpenAI(
            api_key="x", base_url="http://t/v1", http_client=http, max_retries=0
        )
        body = dict(model="m", messages=[{"role": "user", "content": "weather?"}], **request)
        async with app.router.lifespan_context(app):  # the server's media client and pool
            if not request.get("stream"):
                return await client.chat.completions.create(**body)
            return [chunk async for chunk in await client.chat.completions.create(**body)]

    return asyncio.run(run()), llm


def _joined(chunks: list[Any]) -> dict[str, Any]:
    """Content, reasoning and tool calls of a stream, put together as a client would."""
    content, reasoning, calls, reasons = "", "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                if call.id:
                    assert entry["id"] is None, "a call's id comes once"
                    entry["id"] = call.id
                if call.function and call.function.name:
                    entry["name"] += call.function.name
                if call.function and call.function.arguments:
                    entry["arguments"] += call.function.arguments
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return {"content": content, "reasoning": reasoning, "calls": calls, "reasons": reasons}


@pytest.mark.parametrize(
    "parser,text,reasoning",
    [("hermes", HERMES, "\nThe user wants weather.\n"), ("qwen3_coder", CODER, "")],
)
def test_tool_calls_whole_and_streamed(parser: str, text: str, reasoning: str) -> None:
    flags = {"tool_call_parser": parser, "reasoning_parser": "qwen3"}
    whole, llm = _call(text, flags, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert call.id.startswith("call_")
    assert (getattr(choice.message, "reasoning_content", None) or "") == reasoning
    assert "tool_call" not in (choice.message.content or "")
    # The tools reached the chat template.
    assert llm.prompts[0]["chat_template_kwargs"]["tools"][0]["function"]["name"] == "get_weather"
    streamed = _joined(_call(text, flags, tools=TOOLS, stream=True)[0])
    assert streamed["reasons"] == ["tool_calls"]
    assert streamed["content"] == (choice.message.content or "")
    assert streamed["reasoning"] == reasoning
    assert [c["name"] for c in streamed["calls"].values()] == ["get_weather"]
    assert json.loads(streamed["calls"][0]["arguments"]) == {"city": "Paris", "days": 2}


def test_no_tools_means_no_parsing_and_reasoning_split_alone() -> None:
    flags = {"reasoning_parser": "qwen3"}
    whole, llm = _call(HERMES, flags)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop" and not msg.tool_calls
    assert msg.content.startswith("\n\nLet me check.<tool_call>")  # content kept verbatim
    assert "chat_template_kwargs" not in llm.prompts[0]
    none, llm = _call(HERMES, {"tool_call_parser": "hermes"}, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == HERMES and not none.choices[0].message.tool_calls
    assert "chat_template_kwargs" not in llm.prompts[0]  # tool_choice none: tools not rendered


def test_named_tool_choice_is_enforced_by_a_schema_and_read_back() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, llm = _call('{"city": "Paris", "days": 2}', {}, tools=TOOLS, tool_choice=named)
    guide = llm.params[0].guided_decoding
    assert guide.json == TOOLS[0]["function"]["parameters"]  # the call's arguments schema
    choice = whole.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "stop"  # as OpenAI
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    streamed = _joined(_call(text, {}, tools=TOOLS, tool_choice="required", stream=True)[0])
    assert streamed["reasons"] == ["tool_calls"]
    assert [c["name"] for c in streamed["calls"].values()] == ["get_weather"]
    assert json.loads(streamed["calls"][0]["arguments"]) == {"city": "Rome"}
    args = '{"city": "Paris", "days": 2}'
    streamed = _joined(_call(args, {}, tools=TOOLS, tool_choice=named, stream=True)[0])
    assert streamed["reasons"] == ["stop"] and streamed["content"] == ""
    assert streamed["calls"][0]["name"] == "get_weather"
    assert streamed["calls"][0]["arguments"] == args  # fragments of the generated object


def test_required_tool_choice_schema_and_bad_choices() -> None:
    _, llm = _call("[]", {}, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    schema = llm.params[0].guided_decoding.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    item = schema["items"]["anyOf"][0]
    assert item["properties"]["name"] == {"enum": ["get_weather"]}
    other = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(openai.BadRequestError, match="not one of the request's tools"):
        _call("{}", {}, tools=TOOLS, tool_choice=other)
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        _call("{}", {}, tools=TOOLS, tool_choice="required", extra_body={"guided_regex": "a"})
    with pytest.raises(openai.BadRequestError, match="no tools"):
        _call("{}", {}, tool_choice="required")


def test_tool_messages_are_rendered_with_parsed_arguments() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    llm2 = _ScriptedLLM("It is sunny.")
    app = build_app(llm2, Namespace(served_model_name="m"))

    async def post(body: dict[str, Any]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.post("/v1/chat/completions", json=body)

    ok = asyncio.run(post({"model": "m", "messages": messages}))
    assert ok.status_code == 200, ok.text
    sent = llm2.prompts[0]["prompt"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    messages[1]["tool_calls"][0]["function"]["arguments"] = "not json"
    bad = asyncio.run(post({"model": "m", "messages": messages}))
    assert bad.status_code == 400 and "arguments must be a JSON object" in bad.text
    wrong = [{"role": "user", "content": "x", "tool_calls": messages[1]["tool_calls"]}]
    assert asyncio.run(post({"model": "m", "messages": wrong})).status_code == 400


def test_unknown_parser_names_fail_at_startup() -> None:
    with pytest.raises(ValueError, match="known parsers"):
        build_app(_ScriptedLLM(""), Namespace(served_model_name="m", tool_call_parser="nope"))
    with pytest.raises(ValueError, match="known parsers"):
        build_app(_ScriptedLLM(""), Namespace(served_model_name="m", reasoning_parser="r1"))


def test_output_starting_inside_think_when_the_prompt_opens_it() -> None:
    # Qwen3.5/3.6 templates end the prompt with `<think>\n`: the output has no opening tag.
    llm = _ScriptedLLM("\nplan it\n</think>\n\nThe answer.")
    llm.tokenizer = SimpleNamespace(decode=lambda ids: "<|im_start|>assistant\n<think>\n")
    app = build_app(llm, Namespace(served_model_name="m", reasoning_parser="qwen3"))

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
                return await client.post("/v1/chat/completions", json=body)

    message = asyncio.run(post()).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "\nplan it\n"
    assert message["content"] == "\n\nThe answer."


def test_cli_flags() -> None:
    from tensorrt_llm.commands.serve import llm_kwargs, parse_args

    args = parse_args(["--demo", "--reasoning_parser", "qwen3", "--tool_call_parser", "hermes"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("qwen3", "hermes")
    assert "reasoning_parser" not in llm_kwargs(args)  # server options, not LLM arguments
    with pytest.raises(SystemExit):
        parse_args(["--demo", "--tool_call_parser", "mistral"])


def test_parallel_tool_calls_false_returns_the_first_call_only() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    two = call % "Paris" + call % "Rome"
    flags = {"tool_call_parser": "hermes"}
    both, _ = _call(two, flags, tools=TOOLS)
    assert len(both.choices[0].message.tool_calls) == 2
    one, _ = _call(two, flags, tools=TOOLS, parallel_tool_calls=False)
    (only,) = one.choices[0].message.tool_calls
    assert json.loads(only.function.arguments) == {"city": "Paris"}
    streamed = _joined(_call(two, flags, tools=TOOLS, parallel_tool_calls=False, stream=True)[0])
    assert list(streamed["calls"]) == [0] and streamed["reasons"] == ["tool_calls"]


def test_forced_tools_skip_a_template_that_cannot_render_them() -> None:
    from tensorrt_llm.serve.chat_options import template_kwargs, template_renders_tools
    from tensorrt_llm.serve.openai_protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    )
    # "auto": passed on, so a template that cannot render them fails loudly (chat_tokenize).
    assert template_kwargs(body, forced=False, template_renders_tools=False) == {"tools": TOOLS}
    # Forced: the schema makes the call; a template without tools gets none.
    assert template_kwargs(body, forced=True, template_renders_tools=False) is None
    assert template_kwargs(body, forced=True, template_renders_tools=True) == {"tools": TOOLS}
    plain = type("Tok", (), {"chat_template": "{{ messages }}"})()
    assert not template_renders_tools(plain)
    assert template_renders_tools(type("Tok", (), {"chat_template": "{{ tools }}"})())
