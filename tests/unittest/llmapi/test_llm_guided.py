"""Guided decoding end to end: `LLM` on the tiny random Qwen3 checkpoint (CPU), with the overlap
scheduler on and off, and once in process mode.

A random model follows no structure by itself, so every output that parses, validates and ends
with "stop" was shaped by the masks; the unguided requests of a mixed batch must give exactly
what they give without any guided request beside them.
"""

from __future__ import annotations

import json
import queue
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import tensorrt_llm
from tensorrt_llm import LLM, GuidedDecodingParams, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import ERROR_INVALID_INPUT, LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_overlap import OverlapPyExecutor
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "size": {"type": "string", "enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["x", "y"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "inner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
        },
    },
    "required": ["name", "size", "count", "tags", "inner"],
}
# A structural tag whose format is the whole output: `<v>`, an object of the schema, `</v>`.
TAG: dict[str, Any] = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<v>",
        "content": {
            "type": "json_schema",
            "json_schema": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
                "required": ["ok", "n"],
                "additionalProperties": False,
            },
        },
        "end": "</v>",
    },
}
MAX_TOKENS = 160  # the schema closes in about 90 tokens of this tokenizer
PROMPTS = ["hello there", "the weather today is", "numbers like 1, 2, 3"]


def _llm(**kwargs: Any) -> LLM:
    return LLM(
        str(get_or_build_demo_checkpoint("qwen3")),
        max_batch_size=8,
        max_seq_len=512,
        kv_cache_max_tokens=8192,
        **kwargs,
    )


@pytest.fixture(scope="module", params=[False, True], ids=["overlap", "no_overlap"])
def llm(request: pytest.FixtureRequest) -> Any:
    disable = request.param
    with _llm(executor_mode="inproc", disable_overlap_scheduler=disable) as engine:
        assert isinstance(engine._executor, OverlapPyExecutor) != disable
        yield engine


def _guided(guide: GuidedDecodingParams, seed: int | None, max_tokens: int = MAX_TOKENS) -> Any:
    if seed is None:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, guided_decoding=guide)
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, guided_decoding=guide)


def _completions(outputs: list[Any]) -> list[Any]:
    return [out.outputs[0] for out in outputs]


def test_json_schema_greedy_and_sampled(llm: LLM) -> None:
    guide = GuidedDecodingParams(json=SCHEMA)
    seeds = [None, 0, 1, 2, 3]
    params = [_guided(guide, seed) for seed in seeds]
    outs = _completions(llm.generate([PROMPTS[0]] * len(seeds), params, use_tqdm=False))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({out.text for out in outs[1:]}) > 1  # sampling really varied the documents


def test_regex_choice_and_json_object(llm: LLM) -> None:
    regex = r"[a-c]{2,4}-\d{1,3}"
    choices = ["yes", "no", 'say "maybe"']
    params = [
        _guided(GuidedDecodingParams(regex=regex), 7, 40),
        _guided(GuidedDecodingParams(choice=choices), 8, 40),
        _guided(GuidedDecodingParams(json_object=True), 1, 80),
        _guided(GuidedDecodingParams(grammar='root ::= "<" [0-9] [0-9]? ">"'), None, 40),
        _guided(GuidedDecodingParams(structural_tag=json.dumps(TAG)), 3, 80),
    ]
    outs = _completions(llm.generate(PROMPTS[:1] * len(params), params, use_tqdm=False))
    assert all(out.finish_reason == "stop" for out in outs), [out.text for out in outs]
    assert re.fullmatch(regex, outs[0].text), outs[0].text
    assert outs[1].text in choices
    assert isinstance(json.loads(outs[2].text), dict)
    assert re.fullmatch(r"<[0-9]{1,2}>", outs[3].text), outs[3].text
    tagged = re.fullmatch(r"<v>(.*)</v>", outs[4].text, re.S)
    assert tagged, outs[4].text
    jsonschema.validate(json.loads(tagged.group(1)), TAG["format"]["content"]["json_schema"])


def test_min_tokens_yields_to_a_complete_structured_output(llm: LLM) -> None:
    # "yes"/"no" end in a token or two; min_tokens 30 cannot be met inside the grammar, so the
    # request ends where the grammar does instead of failing on an all-banned step.
    guide = GuidedDecodingParams(choice=["yes", "no"])
    params = replace(_guided(guide, 4, 40), min_tokens=30)
    out = llm.generate(PROMPTS[1], params).outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_overlap_accepts_tokens_while_the_next_forward_runs(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the overlap scheduler, step n's tokens reach the matchers after step n+1's forward
    is launched and before its sampling (run, advance, sample), not before scheduling."""
    executor = llm._executor
    if not isinstance(executor, OverlapPyExecutor):
        pytest.skip("the overlap executor's order")
    events: list[str] = []

    def spy(obj: Any, name: str) -> None:
        real = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, wrapped)

    spy(executor.model_engine, "run")
    spy(executor.guided_decoder, "advance")
    spy(executor.sampler, "sample_step")
    out = llm.generate(PROMPTS[0], _guided(GuidedDecodingParams(json=SCHEMA), 9)).outputs[0]
    monkeypatch.undo()
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)
    steps = "".join(e[0] for e in events)  # r(un) a(dvance) s(ample_step)
    assert steps.count("ras") >= len(out.token_ids) - 2, steps


def _free_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=3),
    ]


def test_mixed_batch_leaves_unguided_requests_alone(llm: LLM) -> None:
    alone = _completions(llm.generate(PROMPTS, _free_params(), use_tqdm=False))
    guided = [_guided(GuidedDecodingParams(json=SCHEMA), seed) for seed in (None, 5)]
    # Guided requests first and in between, so rows move against the unguided-only run.
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    free = _free_params()
    params = [guided[0], free[0], free[1], guided[1], free[2]]
    mixed = _completions(llm.generate(prompts, params, use_tqdm=False))
    assert [mixed[i].token_ids for i in (1, 2, 4)] == [out.token_ids for out in alone]
    for out in (mixed[0], mixed[3]):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_invalid_schema_fails_alone(llm: LLM) -> None:
    running = llm.generate_async(PROMPTS[0], replace(_free_params()[0], max_tokens=48))
    with pytest.raises(ValueError, match="invalid guided_decoding json"):
        llm.generate(PROMPTS[1], _guided(GuidedDecodingParams(json={"type": "objec"}), None))
    with pytest.raises(ValueError, match="input 1: invalid guided_decoding regex"):
        bad = _guided(GuidedDecodingParams(regex="(ab"), None)
        llm.generate(PROMPTS[:2], [_free_params()[0], bad], use_tqdm=False)
    out = running.result().outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 48


def test_engine_side_compile_error_fails_only_its_request(llm: LLM) -> None:
    """A grammar that reaches the engine unchecked (PyExecutor used directly) fails with
    invalid_input while the request beside it runs on."""
    executor = llm._executor
    tokenizer = llm.tokenizer
    ids = tokenizer.encode(PROMPTS[0])
    responses: queue.Queue[Any] = queue.Queue()
    good_sp = _guided(GuidedDecodingParams(regex="[0-9]{3}"), None, 20).with_tokenizer(tokenizer)
    bad_sp = _guided(GuidedDecodingParams(regex="(ab"), None, 20).with_tokenizer(tokenizer)
    executor.enqueue_request(LlmRequest(10_001, ids, good_sp), responses.put)
    executor.enqueue_request(LlmRequest(10_002, ids, bad_sp), responses.put)
    final: dict[int, Any] = {}
    tokens: dict[int, list[int]] = {10_001: [], 10_002: []}
    while len(final) < 2:
        response = responses.get(timeout=60)
        tokens[response.request_id].extend(response.new_token_ids)
        if response.finished:
            final[response.request_id] = response
    assert final[10_002].error_code == ERROR_INVALID_INPUT
    assert "does not compile" in final[10_002].error
    assert final[10_001].finish_reason == "stop"
    text = tokenizer.decode(tokens[10_001], skip_special_tokens=True)
    assert len(text) == 3 and text.isdigit()


def test_process_mode() -> None:
    """The grammar travels with the request and compiles in the engine process."""
    with _llm() as llm:
        params = [_guided(GuidedDecodingParams(json=SCHEMA), 4), _free_params()[0]]
        outs = _completions(llm.generate(PROMPTS[:2], params, use_tqdm=False))
        assert outs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(outs[0].text), SCHEMA)
        assert len(outs[1].token_ids) == 24
        with pytest.raises(ValueError, match="invalid guided_decoding grammar"):
            llm.generate(PROMPTS[0], _guided(GuidedDecodingParams(grammar="nope"), None))


def test_missing_xgrammar_is_a_clear_error(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now fails
    with pytest.raises(ImportError, match=r"tensorrt-llm-qwenvl\[structured\]"):
        llm.generate(PROMPTS[0], _guided(GuidedDecodingParams(regex="a"), None))
    monkeypatch.undo()
    out = llm.generate(PROMPTS[0], _guided(GuidedDecodingParams(regex="ab"), None, 8))
    assert out.outputs[0].text == "ab" and out.outputs[0].finish_reason == "stop"


def test_vision_language_model_with_an_image() -> None:
    """The mask works on a VL model's rows too (mRoPE, vision tower in the prefill)."""
    image = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")
    prompt = {"prompt": "what is it", "multi_modal_data": {"image": [image]}}
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}}
    schema["required"] = ["kind"]
    with LLM(
        str(get_or_build_demo_checkpoint("qwen2_vl")), max_batch_size=2, executor_mode="inproc"
    ) as llm:
        params = [_guided(GuidedDecodingParams(json=schema), 6, 40), _free_params()[0]]
        outs = _completions(llm.generate([prompt, prompt], params, use_tqdm=False))
    assert outs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[0].text), schema)
    assert len(outs[1].token_ids) == 24


def test_logit_processors_cannot_lift_the_mask(llm: LLM) -> None:
    """Penalties and logit_bias run on the masked logits: a strongly biased token the grammar
    forbids is still never picked."""
    letter = llm.tokenizer.encode("q", add_special_tokens=False)[0]
    sp = replace(
        _guided(GuidedDecodingParams(regex=r"[0-9]{2,5}"), 2, 20),
        logit_bias={letter: 100.0},
        repetition_penalty=1.5,
        presence_penalty=1.0,
    )
    out = llm.generate(PROMPTS[0], sp).outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"[0-9]{2,5}", out.text), out.text
    free = llm.generate(PROMPTS[0], replace(sp, guided_decoding=None, max_tokens=4)).outputs[0]
    assert letter in free.token_ids  # unguided, the bias does act
