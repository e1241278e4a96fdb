"""Stream chunks built from dicts are byte for byte what the pydantic models would dump."""

from __future__ import annotations

import pytest

from tensorrt_llm.llmapi.logprobs import Logprob
from tensorrt_llm.serve.logprobs_format import TokenTexts
from tensorrt_llm.serve.metrics import ServerMetrics
from tensorrt_llm.serve.openai_protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
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


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return TEXTS[ids[0] % len(TEXTS)]


def _entries() -> list[dict[int, Logprob]]:
    # The sampled token first; the second one is outside the top 2; an impossible token.
    return [
        {1: Logprob(-0.25, 1), 2: Logprob(-1.5, 2)},
        {4: Logprob(-3.0, 7), 1: Logprob(-0.5, 1), 3: Logprob(-0.75, 2)},
        {2: Logprob(float("-inf"), 50), 0: Logprob(0.0, 1), 3: Logprob(-1e-9, 2)},
    ]


@pytest.mark.parametrize("k", [0, 2])
def test_logprob_chunks_match_the_models(k: int) -> None:
    chat, completion = _ctx("chat", False), _ctx("completion", True)
    for ctx in (chat, completion):
        ctx.logprobs, ctx.token_texts = k, TokenTexts(_Tokenizer())
    lp, _ = chat.choice_logprobs(_entries())
    model = ChatChoiceLogprobs.model_validate(lp)
    assert [len(c.top_logprobs) for c in model.content or []] == [k] * 3
    assert model.content is not None and model.content[2].logprob == -9999.0
    if k:
        assert [t.token for t in model.content[1].top_logprobs] == [TEXTS[1], TEXTS[3]]
    choice = ChatStreamChoice(index=0, delta=DeltaMessage(content="x"), logprobs=model)
    want = _model_json(chat, [choice], None)
    assert _chunk_json(chat, [_delta_choice(chat, 0, "x", None, logprobs=lp)]) == want
    clp, end = completion.choice_logprobs(_entries(), text_offset=5)
    cmodel = CompletionLogprobs.model_validate(clp)
    assert cmodel.text_offset == [5, 5 + len(TEXTS[1]), 5 + len(TEXTS[1]) + len(TEXTS[4])]
    assert end == cmodel.text_offset[-1] + len(TEXTS[2])
    assert list(cmodel.top_logprobs[1] or {}) == [TEXTS[4], TEXTS[1], TEXTS[3]]
    choice_c = CompletionChoice(index=1, text="y", finish_reason="stop", logprobs=cmodel)
    want = _model_json(completion, [choice_c], None)
    mine = _delta_choice(completion, 1, "y", "stop", logprobs=clp)
    assert _chunk_json(completion, [mine]) == want


def test_usage_reports_the_prefix_cache_hits() -> None:
    import json
    from types import SimpleNamespace

    from tensorrt_llm.serve.postprocess_handlers import _usage

    def result(prompt: int, cached: int) -> SimpleNamespace:
        out = SimpleNamespace(token_ids=[1, 2])
        return SimpleNamespace(
            prompt_token_ids=[0] * prompt, outputs=[out], num_cached_tokens=cached
        )

    usage = _usage([result(10, 4), result(6, 0)])
    assert usage.prompt_tokens == 16 and usage.completion_tokens == 4
    assert (
        usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 4
    )
    ctx = _ctx("chat", True)
    chunk = json.loads(_chunk_json(ctx, [], usage=usage))
    assert chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert _chunk_json(ctx, [], usage=usage) == _model_json(ctx, [], usage)
