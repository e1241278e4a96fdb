"""Stream chunks built from dicts are byte for byte what the pydantic models would dump."""

from __future__ import annotations

import pytest

from tensorrt_llm.serve.metrics import ServerMetrics
from tensorrt_llm.serve.openai_protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from tensorrt_llm.serve.postprocess_handlers import RequestContext, _chunk_json, _delta_choice

TEXTS = ["", "plain", 'quote " and \\ back', "tab\tnew\nline\r\x00\x1f\x7f", "wörld 世界 🙂 \u2028"]


def _ctx(kind: str, usage: bool) -> RequestContext:
    return RequestContext(
        kind=kind,  # type: ignore[arg-type]
        request_id='id-"1"',
        model="m/ü",
        n=2,
        metrics=ServerMetrics("m"),
        include_usage=usage,
    )


def _model_json(ctx: RequestContext, choices: list, usage: UsageInfo | None) -> str:
    cls = ChatCompletionChunk if ctx.kind == "chat" else CompletionResponse
    chunk = cls(
        id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
    )
    return chunk.model_dump_json(exclude=None if ctx.include_usage else {"usage"})


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_delta_chunks_match_the_models(usage: bool, text: str, reason: str | None) -> None:
    chat, completion = _ctx("chat", usage), _ctx("completion", usage)
    delta = DeltaMessage(content=text) if text else DeltaMessage()
    want = _model_json(chat, [ChatStreamChoice(index=1, delta=delta, finish_reason=reason)], None)
    assert _chunk_json(chat, [_delta_choice(chat, 1, text, reason)]) == want
    want = _model_json(
        completion, [CompletionChoice(index=3, text=text, finish_reason=reason)], None
    )
    assert _chunk_json(completion, [_delta_choice(completion, 3, text, reason)]) == want


def test_role_chunk_and_usage_chunk_match_the_models() -> None:
    ctx = _ctx("chat", True)
    first = [
        ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content="")) for j in (0, 1)
    ]
    mine = [_delta_choice(ctx, j, "", None, role="assistant") for j in (0, 1)]
    assert _chunk_json(ctx, mine) == _model_json(ctx, first, None)
    usage = UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    assert _chunk_json(ctx, [], usage=usage) == _model_json(ctx, [], usage)
