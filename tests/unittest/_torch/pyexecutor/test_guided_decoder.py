"""GuidedDecoder without an engine: masks, matcher advance, compile errors, the cache."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from tensorrt_llm import GuidedDecodingParams, SamplingParams
from tensorrt_llm._torch.pyexecutor.guided_decoder import (
    GuidedDecoder,
    admit_guided,
    unpack_bitmask,
)
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.request_errors import RequestInputError
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm.inputs.registry import load_tokenizer
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

xgr = pytest.importorskip("xgrammar")

VOCAB = 512  # the tiny model's; its tokenizer has fewer tokens (the rest is padding)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(get_or_build_demo_checkpoint("qwen3"))


def _request(rid: int, tokenizer: Any, guide: GuidedDecodingParams | None, **kw: Any) -> Any:
    sp = SamplingParams(max_tokens=32, guided_decoding=guide, **kw).with_tokenizer(tokenizer)
    req = LlmRequest(rid, [1, 2, 3], sp)
    req.context_chunk_size = req.prompt_len  # one chunk: the first step samples
    return req


def _ready(decoder: GuidedDecoder, *reqs: LlmRequest) -> None:
    for req in reqs:
        assert decoder.admit(req) is None
    decoder.prepare(ScheduledRequests(context_requests=list(reqs)))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_unpack_matches_xgrammar_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 16), generator=gen, dtype=torch.int32)
    logits = torch.randn(3, VOCAB, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    allowed = unpack_bitmask(bitmask, VOCAB, VOCAB + 8)
    assert allowed.shape == (3, VOCAB + 8) and not allowed[:, VOCAB:].any()
    assert torch.equal(allowed[:, :VOCAB], expected > float("-inf"))


def test_mask_only_touches_guided_rows(tokenizer: Any) -> None:
    decoder = GuidedDecoder(tokenizer, VOCAB)
    free = _request(0, tokenizer, None)
    guided = _request(1, tokenizer, GuidedDecodingParams(regex="[0-9]+"))
    _ready(decoder, free, guided)
    logits = torch.randn(2, VOCAB + 4)
    masked = decoder.mask_logits(logits, [free, guided])
    assert torch.equal(masked[0], logits[0])  # the unguided row is untouched
    allowed = masked[1].isfinite().nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([i]).isdigit() for i in allowed)
    assert not masked[1, len(tokenizer) :].isfinite().any()  # padding columns never
    assert decoder.mask_logits(logits, [free]) is logits  # no guided row: nothing done


def test_no_guided_request_costs_nothing(tokenizer: Any) -> None:
    decoder = GuidedDecoder(tokenizer, VOCAB)
    req = _request(0, tokenizer, None)
    assert admit_guided(decoder, req) is None and not decoder.active
    assert decoder._compiler is None and decoder._pool is None  # xgrammar never touched
    logits = torch.randn(1, VOCAB)
    assert decoder.mask_logits(logits, [req]) is logits


def test_stale_mask_is_refused(tokenizer: Any) -> None:
    decoder = GuidedDecoder(tokenizer, VOCAB)
    req = _request(0, tokenizer, GuidedDecodingParams(regex="[0-9]+"))
    _ready(decoder, req)
    req.add_in_flight_token()  # its token is not on the host: the matcher has not seen it
    with pytest.raises(RuntimeError, match="stale"):
        decoder.mask_logits(torch.zeros(1, VOCAB), [req])


def test_advance_finishes_on_the_end_id(tokenizer: Any) -> None:
    decoder = GuidedDecoder(tokenizer, VOCAB)
    req = _request(0, tokenizer, GuidedDecodingParams(choice=["yes", "no"]))
    _ready(decoder, req)
    for token in _ids(tokenizer, "no"):
        req.add_new_token(token)
    decoder.advance([req])
    masked = decoder.mask_logits(torch.zeros(1, VOCAB), [req])
    end_id = req.sampling_params.end_id
    assert masked[0].isfinite().nonzero().flatten().tolist() == [end_id]  # only the end
    req.add_new_token(end_id)
    decoder.advance([req])
    assert decoder._states[0].matcher.is_terminated()


def test_terminated_grammar_finishes_without_stop_tokens(tokenizer: Any) -> None:
    decoder = GuidedDecoder(tokenizer, VOCAB)
    req = _request(0, tokenizer, GuidedDecodingParams(choice=["no"]), ignore_eos=True)
    _ready(decoder, req)
    for token in _ids(tokenizer, "no"):
        req.add_new_token(token)
    decoder.advance([req])
    assert req.finish_reason == "stop"


def test_refused_token_fails_the_request(tokenizer: Any) -> None:
    decoder = GuidedDecoder(tokenizer, VOCAB)
    req = _request(0, tokenizer, GuidedDecodingParams(regex="[0-9]+"))
    _ready(decoder, req)
    req.add_new_token(_ids(tokenizer, "x")[0])
    decoder.advance([req])
    assert req.finish_reason == "error" and "refused" in (req.error or "")


def test_compile_error_names_its_request_only(tokenizer: Any) -> None:
    decoder = GuidedDecoder(tokenizer, VOCAB)
    good = _request(0, tokenizer, GuidedDecodingParams(regex="a"))
    bad = _request(1, tokenizer, GuidedDecodingParams(regex="(a"))  # the front end checks this
    assert decoder.admit(good) is None and decoder.admit(bad) is None
    with pytest.raises(RequestInputError) as info:
        decoder.prepare(ScheduledRequests(context_requests=[good, bad]))
    assert info.value.request_ids == (1,) and "does not compile" in info.value.detail
    decoder.release(1)
    decoder.prepare(ScheduledRequests(context_requests=[good]))
    assert decoder._states[0].matcher is not None


def test_prefill_chunks_do_not_wait(tokenizer: Any) -> None:
    decoder = GuidedDecoder(tokenizer, VOCAB)
    req = _request(0, tokenizer, GuidedDecodingParams(regex="a"))
    req.context_chunk_size = 1  # a chunk that does not end the prompt samples nothing
    assert decoder.admit(req) is None
    decoder.prepare(ScheduledRequests(context_requests=[req]))
    assert decoder._states[0].matcher is None


def test_compiled_grammars_are_cached_by_source(tokenizer: Any) -> None:
    decoder = GuidedDecoder(tokenizer, VOCAB)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    first = _request(0, tokenizer, GuidedDecodingParams(json=schema))
    _ready(decoder, first)
    size = decoder._compiler.get_cache_size_bytes()
    assert size > 0
    again = _request(1, tokenizer, GuidedDecodingParams(json=dict(schema)))
    _ready(decoder, again)
    assert decoder._compiler.get_cache_size_bytes() == size  # a hit: nothing new stored
    other = _request(2, tokenizer, GuidedDecodingParams(regex="[a-z]{3}"))
    _ready(decoder, other)
    assert decoder._compiler.get_cache_size_bytes() > size


def test_admit_without_xgrammar_or_tokenizer(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    req = _request(0, tokenizer, GuidedDecodingParams(regex="a"))
    assert "no guided decoder" in (admit_guided(None, req) or "")
    assert "tokenizer" in (GuidedDecoder(None, VOCAB).admit(req) or "")
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    reason = GuidedDecoder(tokenizer, VOCAB).admit(req)
    assert reason is not None and "tensorrt-llm-qwenvl[structured]" in reason
