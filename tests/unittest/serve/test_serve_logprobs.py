"""Logprobs through trtllm-serve with the real openai client (tiny demo checkpoint, CPU).

Chat `logprobs` + `top_logprobs` and completions `logprobs` come back in OpenAI's shapes, with
the values the LLM API gives for the same greedy request; streamed chunks add up to the whole
response; bad combinations are 400s.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from serve_helpers import ServeHandle, user

from tensorrt_llm.sampling_params import SamplingParams

MAX_TOKENS = 6
TOP = 3
PROMPT = "the quick brown fox"


def _direct(served: ServeHandle, prompt: Any, k: int) -> Any:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=k, ignore_eos=True)
    return served.llm.generate(prompt, params).outputs[0]


def _text(served: ServeHandle, token_id: int) -> str:
    return served.llm.tokenizer.decode([token_id])


def _chat(served: ServeHandle, **kw: Any) -> Any:
    return served.client().chat.completions.create(
        model=served.model,
        messages=user(PROMPT),
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
        **kw,
    )


def _check_chat_content(served: ServeHandle, content: list[Any], k: int) -> None:
    want = _direct(served, user(PROMPT), k)
    assert len(content) == len(want.token_ids) == MAX_TOKENS
    for item, tok, entry in zip(content, want.token_ids, want.logprobs, strict=True):
        text = _text(served, tok)
        assert item.token == text and item.bytes == list(text.encode())
        assert item.logprob == pytest.approx(entry[tok].logprob, abs=1e-5)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]
        assert [t.token for t in item.top_logprobs] == [_text(served, t) for t, _ in ranked]
        got = [t.logprob for t in item.top_logprobs]
        assert got == pytest.approx([lp.logprob for _, lp in ranked], abs=1e-5)
        assert got == sorted(got, reverse=True) and len(got) == k
        if k:  # greedy: the sampled token is the most likely
            assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)


def test_chat_logprobs_whole_and_streamed(served: ServeHandle) -> None:
    whole = _chat(served, logprobs=True, top_logprobs=TOP)
    content = whole.choices[0].logprobs.content
    _check_chat_content(served, content, TOP)
    streamed: list[Any] = []
    chunks = 0
    for chunk in _chat(served, logprobs=True, top_logprobs=TOP, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                chunks += 1
                streamed.extend(choice.logprobs.content)
    assert chunks > 1  # per chunk, for that chunk's tokens
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]


def test_chat_logprobs_alone_and_off(served: ServeHandle) -> None:
    alone = _chat(served, logprobs=True).choices[0].logprobs.content
    assert len(alone) == MAX_TOKENS and all(item.top_logprobs == [] for item in alone)
    _check_chat_content(served, alone, 0)
    assert _chat(served).choices[0].logprobs is None
    assert _chat(served, logprobs=False).choices[0].logprobs is None


def _completion(served: ServeHandle, **kw: Any) -> Any:
    return served.client().completions.create(
        model=served.model,
        prompt=PROMPT,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
        **kw,
    )


def test_completion_logprobs_whole_and_streamed(served: ServeHandle) -> None:
    whole = _completion(served, logprobs=TOP).choices[0].logprobs
    want = _direct(served, PROMPT, TOP)
    texts = [_text(served, t) for t in want.token_ids]
    assert whole.tokens == texts
    assert whole.token_logprobs == pytest.approx(
        [e[t].logprob for t, e in zip(want.token_ids, want.logprobs, strict=True)], abs=1e-5
    )
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert whole.text_offset == offsets
    for top, entry in zip(whole.top_logprobs, want.logprobs, strict=True):
        assert set(top) == {_text(served, t) for t in entry}  # sampled + top-k
        assert len(entry) == TOP  # greedy: the sampled token is among the top k
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    tops: list[Any] = []
    for chunk in _completion(served, logprobs=TOP, stream=True):
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is not None:
            for key, values in streamed.items():
                values.extend(getattr(lp, key))
            tops.extend(lp.top_logprobs)
    assert streamed == {
        "tokens": whole.tokens,
        "token_logprobs": whole.token_logprobs,
        "text_offset": whole.text_offset,
    }
    assert tops == whole.top_logprobs
    assert _completion(served).choices[0].logprobs is None


@pytest.mark.parametrize(
    "call",
    [
        lambda s: _chat(s, top_logprobs=2),  # without logprobs: true
        lambda s: _chat(s, logprobs=True, top_logprobs=21),
        lambda s: _completion(s, logprobs=21),
        lambda s: _completion(s, logprobs=-1),
    ],
)
def test_bad_logprob_requests_are_400(served: ServeHandle, call: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call(served)
    assert "logprobs" in str(info.value)
