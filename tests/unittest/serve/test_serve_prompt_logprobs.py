"""Completions `echo` and vLLM's `prompt_logprobs` through trtllm-serve with the real openai
client (tiny demo checkpoint, CPU).

echo prepends the prompt's text (a token-id prompt decoded) to each choice, whole or in the
stream's first chunk; with logprobs the prompt tokens' entries come first (the first token's
null), with the values the LLM API gives; `prompt_logprobs` comes back in vLLM's shape (the
completion choice; the chat response); streams refuse it and chat refuses echo (400s).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from serve_helpers import ServeHandle, user

from tensorrt_llm.sampling_params import SamplingParams

MAX_TOKENS = 4
TOP = 2
PROMPT = "the quick brown fox"


def _direct(served: ServeHandle, prompt: Any, k: int | None = None) -> Any:
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=k, prompt_logprobs=k
    )
    return served.llm.generate(prompt, params)


def _text(served: ServeHandle, token_id: int) -> str:
    return served.llm.tokenizer.decode([token_id])


def _completion(served: ServeHandle, prompt: Any = PROMPT, **kw: Any) -> Any:
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    kw.setdefault("temperature", 0)
    return served.client().completions.create(
        model=served.model, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=extra, **kw
    )


def test_echo_prepends_the_prompt_text(served: ServeHandle) -> None:
    plain = _completion(served).choices[0]
    echoed = _completion(served, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text and plain.text
    assert echoed.logprobs is None
    ids = list(_direct(served, PROMPT).prompt_token_ids)
    by_ids = _completion(served, prompt=ids, echo=True, n=2, temperature=1, seed=1)
    decoded = served.llm.tokenizer.decode(ids)
    assert len(by_ids.choices) == 2
    assert all(c.text.startswith(decoded) for c in by_ids.choices)


def test_echo_with_logprobs_puts_the_prompt_tokens_first(served: ServeHandle) -> None:
    want = _direct(served, PROMPT, TOP)
    ids = list(want.prompt_token_ids)
    plain = _completion(served, logprobs=TOP).choices[0].logprobs
    whole = _completion(served, echo=True, logprobs=TOP).choices[0]
    lp = whole.logprobs
    n = len(ids)
    assert lp.tokens == [_text(served, t) for t in ids] + plain.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_values = [want.prompt_logprobs[p][ids[p]].logprob for p in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(prompt_values, abs=1e-5)
    assert lp.token_logprobs[n:] == pytest.approx(plain.token_logprobs, abs=1e-6)
    for p in range(1, n):
        entry = want.prompt_logprobs[p]
        kept = {t for t, v in entry.items() if t == ids[p] or v.rank <= TOP}
        assert set(lp.top_logprobs[p]) == {_text(served, t) for t in kept}
    assert lp.top_logprobs[n:] == plain.top_logprobs
    texts = lp.tokens
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert whole.text.startswith(PROMPT)

    streamed: dict[str, list[Any]] = {k: [] for k in ("tokens", "token_logprobs", "text_offset")}
    tops: list[Any] = []
    text = ""
    first_text = None
    for chunk in _completion(served, echo=True, logprobs=TOP, stream=True):
        for choice in chunk.choices:
            if first_text is None:
                first_text = choice.text
            text += choice.text
            if choice.logprobs is not None:
                for key, values in streamed.items():
                    values.extend(getattr(choice.logprobs, key))
                tops.extend(choice.logprobs.top_logprobs)
    assert first_text is not None and first_text.startswith(PROMPT)
    assert text == whole.text
    assert streamed == {k: getattr(lp, k) for k in streamed}
    assert tops == lp.top_logprobs


def test_streamed_echo_without_logprobs_leads_with_the_prompt(served: ServeHandle) -> None:
    chunks = [c for c in _completion(served, echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].text.startswith(PROMPT)
    whole = _completion(served, echo=True).choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == whole


def _check_vllm_shape(served: ServeHandle, got: list[Any], want: Any, k: int) -> None:
    ids = list(want.prompt_token_ids)
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry = want.prompt_logprobs[p]
        assert list(got[p]) == [str(t) for t in entry]  # the prompt token first
        for t, value in entry.items():
            item = got[p][str(t)]
            assert item["logprob"] == pytest.approx(value.logprob, abs=1e-5)
            assert item["rank"] == value.rank
            assert item["decoded_token"] == _text(served, t)
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_field_in_vllm_shape(served: ServeHandle) -> None:
    choice = _completion(served, extra_body={"prompt_logprobs": TOP}).choices[0]
    want = _direct(served, PROMPT, TOP)
    _check_vllm_shape(served, choice.model_extra["prompt_logprobs"], want, TOP)
    assert choice.logprobs is None  # prompt_logprobs alone adds no output logprobs
    chat = served.client().chat.completions.create(
        model=served.model,
        messages=user(PROMPT),
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"prompt_logprobs": 0},
    )
    want = _direct(served, user(PROMPT), 0)
    _check_vllm_shape(served, chat.model_extra["prompt_logprobs"], want, 0)
    assert chat.choices[0].logprobs is None
    assert _completion(served).choices[0].model_extra.get("prompt_logprobs") is None


@pytest.mark.parametrize(
    "call,word",
    [
        (lambda s: _completion(s, stream=True, extra_body={"prompt_logprobs": 1}), "stream"),
        (lambda s: _completion(s, extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
        (
            lambda s: s.client().chat.completions.create(
                model=s.model, messages=user(PROMPT), max_tokens=1, extra_body={"echo": True}
            ),
            "echo",
        ),
    ],
)
def test_refused_combinations_are_400(served: ServeHandle, call: Any, word: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        result = call(served)
        list(result) if not hasattr(result, "choices") else None
    assert word in str(info.value)


def test_streamed_echo_with_logprobs_and_n_leads_every_choice(served: ServeHandle) -> None:
    """n = 2: only the first completion's engine request computes the prompt's logprobs; each
    choice's first chunk still leads with the prompt and its entries."""
    ids = list(_direct(served, PROMPT).prompt_token_ids)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    first_null: dict[int, bool] = {}
    stream = _completion(served, echo=True, logprobs=1, n=2, temperature=1, seed=5, stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.index not in texts:
                assert choice.text.startswith(PROMPT)
                first_null[choice.index] = choice.logprobs.token_logprobs[0] is None
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
    assert sorted(texts) == [0, 1] and all(first_null.values())
    for index in (0, 1):
        assert tokens[index][: len(ids)] == [_text(served, t) for t in ids]
        assert len(tokens[index]) == len(ids) + MAX_TOKENS
