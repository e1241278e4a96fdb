"""`CompletionOutput.logprobs` -> OpenAI's logprobs objects (chat and text completions).

Each entry is TensorRT-LLM's `dict[token_id, Logprob]`: the sampled token first, then the k
most likely (ranked 1..k). Token strings are vLLM's: each id decoded alone
(`tokenizer.decode([id])`, special tokens kept), so a byte-level BPE piece of a multi-byte
character reads as U+FFFD; `bytes` are that string's UTF-8 bytes, as vLLM sends them. JSON has
no -inf: an impossible token's logprob is sent as -9999.0 (vLLM's floor).

The objects are plain dicts in the field order of the protocol models (`ChatChoiceLogprobs`,
`CompletionLogprobs`), so stream chunks built from them equal the models' dumps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_MIN_LOGPROB = -9999.0


class TokenTexts:
    """Token id -> its text, decoded once per id (a vocabulary's worth at most). Without a
    tokenizer the text is vLLM's `token_id:N` spelling (never a silently missing field)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self._tokenizer.decode([token_id]) or ""
            self._cache[token_id] = text
        return text


def _value(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _top(entry: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """The k most likely tokens of an entry, most likely first (the sampled token is among
    them only when it ranks in the top k)."""
    if k <= 0:
        return []
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank or 0, -item[1].logprob))
    return ranked[:k]


def _token(text_of: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text = text_of(token_id)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[dict[int, Any]], k: int, text_of: TokenTexts) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion: {"content": [one object per token]}."""
    content = []
    for entry in entries:
        token_id, sampled = next(iter(entry.items()))
        item = _token(text_of, token_id, sampled.logprob)
        item["top_logprobs"] = [_token(text_of, t, lp.logprob) for t, lp in _top(entry, k)]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    entries: Sequence[dict[int, Any]], text_of: TokenTexts, text_offset: int = 0
) -> tuple[dict[str, Any], int]:
    """`choices[i].logprobs` of a text completion and the text offset after its tokens.

    `top_logprobs[i]` maps token text -> logprob over the entry (the sampled token plus the
    top k, as vLLM); `text_offset` counts the characters of the token texts before each one,
    from `text_offset` (a stream's running count).
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        token_id, sampled = next(iter(entry.items()))
        text = text_of(token_id)
        offsets.append(text_offset)
        text_offset += len(text)
        tokens.append(text)
        token_logprobs.append(_value(sampled.logprob))
        top_logprobs.append({text_of(t): _value(lp.logprob) for t, lp in entry.items()})
    out = {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }
    return out, text_offset


def prompt_logprobs_json(
    entries: Sequence[dict[int, Any] | None], text_of: TokenTexts
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or token id -> {logprob,
    rank, decoded_token}, the prompt token first, then the top k."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _value(lp.logprob), "rank": lp.rank, "decoded_token": text_of(t)}
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def echo_completion_logprobs(
    prompt_ids: Sequence[int],
    prompt_entries: Sequence[dict[int, Any] | None],
    k: int,
    text_of: TokenTexts,
) -> tuple[dict[str, Any], int]:
    """The echoed prompt's part of a text completion's logprobs (OpenAI's echo: the first
    token has null logprob and top_logprobs; each later one its logprob and the top k) and the
    text offset after it, where the generated tokens' part continues."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for token_id, entry in zip(prompt_ids, prompt_entries, strict=True):
        text = text_of(token_id)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_value(entry[token_id].logprob))
        # The prompt token plus the request's k (prompt_logprobs may have asked for more).
        kept = [(t, lp) for t, lp in entry.items() if t == token_id or (lp.rank or 0) <= k]
        top_logprobs.append({text_of(t): _value(lp.logprob) for t, lp in kept})
    out = {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }
    return out, offset
