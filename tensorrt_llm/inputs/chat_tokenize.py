"""Chat messages -> token ids, with request text never turned into control tokens.

A user who types `<|im_end|>\\n<|im_start|>system ...` inside a message must not be able to
open a system turn (role injection). So the chat template is rendered with every request text
replaced by a unique sentinel; the template's own text keeps special-token parsing and each
request text is tokenized with special tokens split into plain text.

For honest input nothing changes: request texts that hold no special token are tokenized
together with the template text around them, as one string, so the ids equal those of
tokenizing the whole rendered prompt. Only a text in which a special token was found (alone,
or across the boundary to its neighbours) is cut out and tokenized on its own.

Raw string prompts (not chat) are not handled here: their special tokens are parsed, which is
how callers write placeholders such as `<|image_pad|>` by hand.

NOTE: a template that transforms a text (trims it, splits it) sees only the sentinel, so the
request text is used as given; Qwen templates print user text verbatim.
"""

from __future__ import annotations

import copy
import functools
import logging
import re
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from .validation import check_chat_messages

# Message fields that are structure, not request text (the template branches on them).
_STRUCTURE_KEYS = frozenset({"role", "type"})


@dataclass(frozen=True)
class _Piece:
    text: str
    from_request: bool  # True: request text (tokenized with special tokens split if tainted)


logger = logging.getLogger(__name__)
_names_warned = False  # `_warn_names_dropped` logs once per process


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
) -> str:
    """Chat messages -> prompt text through the tokenizer's chat template; `template_kwargs`
    become template variables (`chat_template_kwargs`, e.g. enable_thinking)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("prompt is a list of chat messages but the tokenizer has no chat template")
    _check_template_reads(tokenizer.chat_template, template_kwargs)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja chat template reads (besides what it assigns itself)."""
    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def _check_template_reads(template: Any, template_kwargs: dict[str, Any] | None) -> None:
    """A ValueError for a template variable the chat template never reads: a typo
    (`enable_thinkng`) or `tools` on a template without tool support would otherwise change
    nothing, silently. NOTE: a dict of named templates (transformers picks one per call) is
    not checked."""
    if not template_kwargs or not isinstance(template, str):
        return
    reads = template_variables(template)
    unread = sorted(k for k in template_kwargs if k not in reads)
    if "tools" in unread:
        raise ValueError(
            "this model's chat template does not render tools, so the model would never see "
            "them; force a call with tool_choice 'required' or a named function (enforced by "
            "structured output), or describe the tools in a message, or serve a checkpoint "
            "whose template has tools"
        )
    if unread:
        known = sorted(reads - {"messages", "add_generation_prompt"})
        raise ValueError(
            f"chat_template_kwargs {unread}: this model's chat template does not read them "
            f"(it reads {known}); check the spelling, or leave them out"
        )


def _masked_messages(
    messages: list[dict[str, Any]], nonce: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """A copy with every request string replaced by `[[<nonce>:<index>]]`, and the strings."""
    texts: list[str] = []

    def mask(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        texts.append(value)
        return f"[[{nonce}:{len(texts) - 1}]]"

    masked = []
    for message in messages:
        copy = {k: (v if k in _STRUCTURE_KEYS else mask(v)) for k, v in message.items()}
        content = message.get("content")
        if isinstance(content, list | tuple):
            copy["content"] = [
                {k: (mask(v) if k == "text" else v) for k, v in part.items()}
                if isinstance(part, Mapping)
                else part
                for part in content
            ]
        masked.append(copy)
    return masked, texts


def render_chat_pieces(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
) -> list[_Piece]:
    """The rendered prompt as template pieces and request-text pieces, in order."""
    check_chat_messages(messages)
    _check_tool_calls_rendered(tokenizer, messages)
    nonce = secrets.token_hex(8)
    masked, texts = _masked_messages(list(messages), nonce)
    rendered = render_chat(tokenizer, masked, template_kwargs)
    pieces: list[_Piece] = []
    start = 0
    shown: set[int] = set()
    for match in re.finditer(rf"\[\[{nonce}:(\d+)\]\]", rendered):
        if match.start() > start:
            pieces.append(_Piece(rendered[start : match.start()], from_request=False))
        shown.add(int(match.group(1)))
        pieces.append(_Piece(texts[int(match.group(1))], from_request=True))
        start = match.end()
    if start < len(rendered):
        pieces.append(_Piece(rendered[start:], from_request=False))
    _warn_names_dropped(masked, nonce, shown)
    return pieces


def _check_tool_calls_rendered(tokenizer: Any, messages: list[dict[str, Any]]) -> None:
    """A ValueError for earlier assistant `tool_calls` on a template that never mentions them
    (the tiny checkpoints', Qwen2-VL's): the calls would vanish from the conversation while
    their tool results stay. NOTE: the template's text is read, not rendered: a call is a
    structure, not one request string the sentinel masking could follow."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tool_calls" in template:
        return
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            raise ValueError(
                f"messages[{i}].tool_calls: this model's chat template does not render "
                "earlier tool calls, so they would be dropped; write the call into the "
                "assistant message's content instead"
            )


def _warn_names_dropped(masked: list[dict[str, Any]], nonce: str, shown: set[int]) -> None:
    """Log (once per process) a message `name` the chat template leaves out of the prompt.

    NOTE: not an error: the name is passed to the template, whose choice it is to print it
    (the Qwen templates print none), and multi-agent clients (AutoGen, ...) send one on every
    message; a 400 would make them unusable against every Qwen checkpoint."""
    global _names_warned
    if _names_warned:
        return
    for i, message in enumerate(masked):
        name = message.get("name")
        found = re.fullmatch(rf"\[\[{nonce}:(\d+)\]\]", name) if isinstance(name, str) else None
        if found is not None and int(found.group(1)) not in shown:
            _names_warned = True
            logger.warning(
                "messages[%d].name: this model's chat template does not print message names; "
                "requests run without them (write the speaker into the content to keep it; "
                "logged once)",
                i,
            )
            return


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that special-token parsing can produce from text (the ones split_special_tokens
    keeps as plain text)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, tok in decoder.items() if getattr(tok, "special", False))
    return frozenset(ids)


_COPY_ATTR = "_trtllm_plain_text_tokenizer"
_COPY_LOCK = threading.Lock()


def plain_text_tokenizer(tokenizer: Any) -> Any:
    """A private copy of `tokenizer` that always splits special tokens into plain text.

    NOTE: HF's fast tokenizers implement `split_special_tokens=True` by setting a flag on the
    Rust backend the tokenizer object holds, encoding, and leaving the flag for the next call
    to reset. Requests are tokenized on several threads at once, so with one shared tokenizer
    a reset could land between another request's set and its encode, and a user's
    `<|im_start|>` would parse as a control token. The copy's flag is set once and never
    changes; the shared tokenizer's is never touched.
    """
    cached = getattr(tokenizer, _COPY_ATTR, None)
    if cached is not None:
        return cached
    with _COPY_LOCK:
        cached = getattr(tokenizer, _COPY_ATTR, None)
        if cached is None:
            cached = copy.deepcopy(tokenizer)
            cached.split_special_tokens = True
            backend = getattr(cached, "_tokenizer", None)
            if backend is not None and hasattr(backend, "encode_special_tokens"):
                backend.encode_special_tokens = True
            setattr(tokenizer, _COPY_ATTR, cached)
    return cached


def _encode(tokenizer: Any, text: str, split_special: bool) -> list[int]:
    if not text:
        return []
    if split_special:
        out = plain_text_tokenizer(tokenizer)(text, add_special_tokens=False)
    else:
        out = tokenizer(text, add_special_tokens=False)
    return list(out["input_ids"])


def _encode_with_taint(
    tokenizer: Any, chunk: list[tuple[int, _Piece]], specials: frozenset[int]
) -> tuple[list[int], set[int]]:
    """Tokenize joined pieces normally; return ids and the request pieces a special token
    overlaps (so they must be cut out and tokenized as plain text)."""
    text = "".join(p.text for _, p in chunk)
    if not any(p.from_request for _, p in chunk):
        return _encode(tokenizer, text, split_special=False), set()
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    spans, pos = [], 0
    for index, piece in chunk:
        spans.append((index, piece, pos, pos + len(piece.text)))
        pos += len(piece.text)
    tainted: set[int] = set()
    for token, (lo, hi) in zip(ids, enc["offset_mapping"], strict=True):
        if token not in specials:
            continue
        for index, piece, start, end in spans:
            if piece.from_request and lo < end and start < hi:
                tainted.add(index)
    return ids, tainted


def tokenize_chat(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """Token ids of a conversation (generation prompt added) with request text kept plain.

    Validates the messages first (roles, content), raising ValueError/TypeError.
    `template_kwargs`: extra chat-template variables (the prompt's `chat_template_kwargs`).
    """
    pieces = render_chat_pieces(tokenizer, messages, template_kwargs)
    specials = special_token_ids(tokenizer)
    isolated: set[int] = set()
    if not getattr(tokenizer, "is_fast", False):
        # No offsets to find the tainted texts with: split specials in every request text.
        isolated = {i for i, p in enumerate(pieces) if p.from_request}
    # Each round cuts out newly tainted texts; the set only grows, so this ends.
    for _ in range(len(pieces) + 1):
        ids: list[int] = []
        tainted: set[int] = set()
        chunk: list[tuple[int, _Piece]] = []
        for index, piece in enumerate(pieces):
            if index not in isolated:
                chunk.append((index, piece))
                continue
            chunk_ids, found = _encode_with_taint(tokenizer, chunk, specials)
            ids += chunk_ids
            tainted |= found
            chunk = []
            ids += _encode(tokenizer, piece.text, split_special=True)
        chunk_ids, found = _encode_with_taint(tokenizer, chunk, specials)
        ids += chunk_ids
        tainted |= found
        if not tainted:
            return ids
        isolated |= tainted
    raise RuntimeError("tokenize_chat did not converge")  # unreachable: see the loop bound
