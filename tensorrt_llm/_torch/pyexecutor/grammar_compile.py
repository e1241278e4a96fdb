"""xgrammar behind three functions: import it, check a grammar, compile one.

`check_grammar` parses a request's grammar without a tokenizer (cheap, milliseconds), so the
front end can refuse a bad schema, regex or EBNF with a ValueError before submission, in
either executor mode. `compile_source` is the engine's tokenizer-bound compilation (masks
per token), cached by xgrammar's `GrammarCompiler` by source text and options.
"""

from __future__ import annotations

import re
from typing import Any

from ...guided_decoding_params import GrammarSource, GuidedDecodingParams

MISSING_XGRAMMAR = (
    "guided decoding needs the xgrammar package: pip install 'tensorrt-llm-qwenvl[structured]'"
)
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the caller wants the rest.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:.]+\]\s+\S+:\d+:\s*")
# Compact separators: free whitespace lets a model pad a document with blanks until max_tokens.
_JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False}


def import_xgrammar() -> Any:
    """The xgrammar module; ImportError naming the extra when it is not installed."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(MISSING_XGRAMMAR) from exc
    return xgrammar


def _clean(exc: BaseException) -> str:
    text = str(exc).strip()
    first = _CPP_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)
    return first or type(exc).__name__


def _build(xgr: Any, source: GrammarSource, target: Any) -> Any:
    """`target` is xgrammar's Grammar class (parse only) or a GrammarCompiler (compile)."""
    parse = target is xgr.Grammar
    if source.kind == "json_schema":
        call = target.from_json_schema if parse else target.compile_json_schema
        return call(source.text, **_JSON_OPTIONS)
    if source.kind == "json_object":
        # Non-strict: {"type": "object"} then takes any properties (strict would mean "{}").
        call = target.from_json_schema if parse else target.compile_json_schema
        return call(source.text, strict_mode=False, **_JSON_OPTIONS)
    if source.kind == "regex":
        return target.from_regex(source.text) if parse else target.compile_regex(source.text)
    if source.kind == "structural_tag":
        call = target.from_structural_tag if parse else target.compile_structural_tag
        return call(source.text)
    return target.from_ebnf(source.text) if parse else target.compile_grammar(source.text)


def check_grammar(params: GuidedDecodingParams) -> None:
    """ValueError naming the problem when the request's grammar does not parse; ImportError
    naming the extra without xgrammar."""
    xgr = import_xgrammar()
    try:
        _build(xgr, params.grammar_source(), xgr.Grammar)
    except Exception as exc:  # xgrammar raises RuntimeError from C++ for every parse error
        raise ValueError(f"invalid guided_decoding {params.kind}: {_clean(exc)}") from exc


def compile_source(compiler: Any, source: GrammarSource) -> Any:
    """The `CompiledGrammar` of `source` (from the compiler's cache when seen before);
    ValueError when it does not compile."""
    xgr = import_xgrammar()
    try:
        return _build(xgr, source, compiler)
    except Exception as exc:
        raise ValueError(f"guided decoding grammar does not compile: {_clean(exc)}") from exc
