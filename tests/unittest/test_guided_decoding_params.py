"""GuidedDecodingParams: validation at construction, the grammar it compiles to, and the
front end's grammar check (a ValueError naming the problem; ImportError without xgrammar)."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

import tensorrt_llm.llmapi
import tensorrt_llm.sampling_params
from tensorrt_llm import GuidedDecodingParams, SamplingParams
from tensorrt_llm._torch.pyexecutor.grammar_compile import check_grammar

xgr = pytest.importorskip("xgrammar")

# `<a>` then a JSON object with an integer `n`, then `</a>`: the whole output.
TAG = json.dumps(
    {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<a>",
            "content": {"type": "json_schema", "json_schema": {
                "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            }},
            "end": "</a>",
        },
    }
)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of .*got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json": {"type": "object"}, "json_object": True}, "got json, json_object"),
        ({"json_object": 1}, "json_object must be a bool"),
        ({"json_object": False}, "got none"),
        ({"json": "{not json"}, "json is not valid JSON text"),
        ({"json": "[1, 2]"}, "JSON schema object"),
        ({"json": 3}, "JSON schema object"),
        ({"json": {"type": "object", "default": {1, 2}}}, "not JSON-serialisable"),
        ({"regex": ""}, "regex must be a non-empty str"),
        ({"grammar": 5}, "grammar must be a non-empty str"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": "yes"}, "choice must be a non-empty list"),
        ({"choice": ["yes", ""]}, "each choice must be a non-empty str"),
        ({"choice": ["yes", 1]}, "each choice must be a non-empty str"),
        ({"structural_tag": "{oops"}, "structural_tag is not valid JSON text"),
        ({"structural_tag": "[1]"}, "structural_tag must be the JSON text of an object"),
        ({"structural_tag": {"type": "structural_tag"}}, "must be the JSON text of an object"),
        ({"structural_tag": TAG, "regex": "a"}, "got regex, structural_tag"),
    ],
)
def test_construction_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GuidedDecodingParams(**kwargs)


def test_sampling_params_field() -> None:
    guide = GuidedDecodingParams(regex="[0-9]+")
    sp = SamplingParams(guided_decoding=guide)
    assert sp.guided_decoding is guide
    assert SamplingParams().guided_decoding is None
    assert pickle.loads(pickle.dumps(sp)) == sp  # what process mode sends to the engine
    with pytest.raises(ValueError, match="guided_decoding must be a GuidedDecodingParams"):
        SamplingParams(guided_decoding={"regex": "a"})  # type: ignore[arg-type]
    assert tensorrt_llm.llmapi.GuidedDecodingParams is GuidedDecodingParams
    assert tensorrt_llm.sampling_params.GuidedDecodingParams is GuidedDecodingParams


def test_grammar_sources() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    src = GuidedDecodingParams(json=schema).grammar_source()
    assert src.kind == "json_schema" and list(__import__("json").loads(src.text)) == list(schema)
    assert GuidedDecodingParams(json='{"type": "string"}').grammar_source().text == (
        '{"type": "string"}'
    )
    assert GuidedDecodingParams(json_object=True).grammar_source().kind == "json_object"
    assert GuidedDecodingParams(regex="a+").grammar_source().kind == "regex"
    assert GuidedDecodingParams(grammar='root ::= "x"').grammar_source().text == 'root ::= "x"'
    assert GuidedDecodingParams(choice=["a", "b"]).grammar_source().text == 'root ::= "a" | "b"'
    assert GuidedDecodingParams(choice=["a"]).kind == "choice"
    tag = GuidedDecodingParams(structural_tag=TAG)
    assert tag.kind == "structural_tag" and tag.grammar_source().text == TAG


def _accepts(grammar: object, text: str) -> bool:
    """Whether an xgrammar matcher over raw bytes takes exactly `text` and then may end."""
    data = text.encode()
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[256])  # one token per byte
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    return all(matcher.accept_token(b) for b in data) and matcher.accept_token(256)


def test_structural_tag_compiles_to_its_format() -> None:
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[256])
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(TAG)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(b) for b in text.encode()) and matcher.accept_token(256)

    assert accepts('<a>{"n": 3}</a>')
    assert not accepts('<a>{"n": "3"}</a>') and not accepts('{"n": 3}')


def test_choice_escaping_keeps_the_exact_strings() -> None:
    choices = ['say "hi"', "back\\slash", "new\nline", "tab\tend", "é😀", "a|b ::= c"]
    grammar = GuidedDecodingParams(choice=choices).grammar_source().text
    for choice in choices:
        assert _accepts(grammar, choice), choice
    assert not _accepts(grammar, "say hi")
    assert not _accepts(grammar, "a")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": {"type": "objec"}}, "invalid guided_decoding json: Unsupported type"),
        ({"json": {"$ref": "#/nowhere"}}, "invalid guided_decoding json"),
        ({"regex": "(ab"}, "invalid guided_decoding regex: .*parenthesis"),
        ({"grammar": 'start ::= "a"'}, "invalid guided_decoding grammar: .*root"),
        ({"grammar": 'root ::= "a" |'}, "invalid guided_decoding grammar: EBNF parser error"),
        (
            {"structural_tag": '{"type": "structural_tag", "format": {"type": "nope"}}'},
            "invalid guided_decoding structural_tag",
        ),
    ],
)
def test_check_grammar_refuses(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_grammar(GuidedDecodingParams(**kwargs))
    assert ".cc:" not in str(info.value)  # xgrammar's C++ location is cut


def test_check_grammar_accepts() -> None:
    for kwargs in (
        {"json": {"type": "object", "properties": {"a": {"enum": [1, 2]}}}},
        {"json_object": True},
        {"regex": r"\d{3}-[a-z]+"},
        {"choice": ["x", "y"]},
        {"grammar": 'root ::= "a" b\nb ::= [0-9]+'},
        {"structural_tag": TAG},
    ):
        check_grammar(GuidedDecodingParams(**kwargs))


def test_missing_xgrammar_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'tensorrt-llm-qwenvl\[structured\]'"):
        check_grammar(GuidedDecodingParams(regex="a"))
