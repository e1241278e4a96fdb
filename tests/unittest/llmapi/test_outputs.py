"""Incremental detokenization and stop-string cutting, token by token, on a byte-level BPE."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from tensorrt_llm.llmapi.outputs import CompletionOutput, CompletionState, IncrementalDetokenizer
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

TEXT = "Hello wörld, 世界 🙂 says the cat; the end. Ünïcode again 🙂!"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(get_or_build_demo_checkpoint(), local_files_only=True)


def test_incremental_matches_full_decode(tokenizer: Any) -> None:
    ids = tokenizer(TEXT)["input_ids"]
    # Multi-byte characters really are split over several tokens here.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == TEXT
    assert detok.finish() == TEXT


def stream(state: CompletionState, ids: list[int]) -> list[str]:
    """Feed one token per update; returns the text delta of each update."""
    deltas = []
    for i in ids:
        state.begin_update()
        state.add_tokens([i])
        deltas.append(state.output.text_diff)
        if state.output.finished:
            break
    if not state.output.finished:
        state.begin_update()
        state.finish("length")
        deltas.append(state.output.text_diff)
    return deltas


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_wait_for_min_tokens(tokenizer: Any, include: bool) -> None:
    text = "the cat; the cat; the cat."
    ids = tokenizer(text)["input_ids"]
    lengths = [len(tokenizer.decode(ids[: k + 1])) for k in range(len(ids))]
    first_end = text.find("cat") + 3
    # min_tokens covers the first "cat" (and one more token): the second one stops it.
    min_tokens = next(k for k, n in enumerate(lengths) if n >= first_end) + 2
    state = CompletionState(
        CompletionOutput(0), tokenizer, ["cat"], include_stop_str=include, min_tokens=min_tokens
    )
    deltas = stream(state, ids)
    second = text.find("cat", first_end)
    assert state.output.text == text[: second + (3 if include else 0)]
    assert state.output.stop_reason == "cat" and "".join(deltas) == state.output.text
    plain = CompletionState(CompletionOutput(0), tokenizer, ["cat"])
    stream(plain, ids)
    assert plain.output.text == "the "


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_and_streamed_prefix(tokenizer: Any, include: bool) -> None:
    ids = tokenizer(TEXT)["input_ids"]
    stop = "the end"
    state = CompletionState(CompletionOutput(0), tokenizer, ["zzz", stop], include_stop_str=include)
    deltas = stream(state, ids)
    cut = TEXT.find(stop) + (len(stop) if include else 0)
    assert state.output.text == TEXT[:cut]
    assert (state.output.finish_reason, state.output.stop_reason) == ("stop", stop)
    # The streamed pieces add up to the final text: nothing was shown and then taken back.
    assert "".join(deltas) == state.output.text
    assert len(state.output.token_ids) < len(ids)  # stopped early


def test_no_stop_streams_everything(tokenizer: Any) -> None:
    ids = tokenizer(TEXT)["input_ids"]
    state = CompletionState(CompletionOutput(0), tokenizer, ["never"])
    deltas = stream(state, ids)
    assert "".join(deltas) == state.output.text == TEXT
    assert state.output.finish_reason == "length" and state.output.token_ids == ids


def test_text_ids_exclude_a_stop_token(tokenizer: Any) -> None:
    ids = tokenizer("abc def")["input_ids"]
    state = CompletionState(CompletionOutput(0), tokenizer, [])
    state.add_tokens(ids, ids[:-1])
    state.finish("stop", ids[-1])
    assert state.output.token_ids == ids
    assert state.output.text == tokenizer.decode(ids[:-1])
    assert state.output.stop_reason == ids[-1]


def test_detokenize_off_keeps_ids_only(tokenizer: Any) -> None:
    state = CompletionState(CompletionOutput(0), tokenizer, ["x"], detokenize=False)
    state.add_tokens([5, 6])
    state.finish("length")
    assert state.output.text == "" and state.output.token_ids == [5, 6]


def test_backend_decode_equals_the_tokenizers_decode(tokenizer: Any) -> None:
    # The detokenizer decodes through the Rust tokenizer directly; it must give what
    # tokenizer.decode gives, special tokens (skipped) and split characters included.
    import random

    from tensorrt_llm.llmapi.outputs import _backend_decoder

    assert _backend_decoder(tokenizer, True) is not None
    rng = random.Random(0)
    ids = tokenizer(TEXT)["input_ids"] + list(tokenizer.all_special_ids)
    for _ in range(200):
        sample = rng.sample(ids, rng.randint(1, 12))
        detok = IncrementalDetokenizer(tokenizer)
        detok.add(sample)
        assert detok.finish() == tokenizer.decode(sample, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_kept_or_skipped_as_asked(tokenizer: Any, skip: bool) -> None:
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer("a cat")["input_ids"], special, *tokenizer(" sat")["input_ids"]]
    state = CompletionState(
        CompletionOutput(0), tokenizer, [], final_text_only=False, skip_special_tokens=skip
    )
    deltas = stream(state, ids)
    want = "a cat sat" if skip else "a cat<|im_end|> sat"
    assert state.output.text == "".join(deltas) == want
