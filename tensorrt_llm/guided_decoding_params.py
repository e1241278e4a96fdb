"""GuidedDecodingParams: the structure one request's output must follow (TensorRT-LLM's name).

Plain data, no xgrammar import: it is pickled with `SamplingParams` to the engine process,
and `grammar_source()` gives the text the engine compiles (and caches by). The grammar itself
is checked by `_torch/pyexecutor/grammar_compile.py` when the request is prepared.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]
_GUIDES = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GrammarSource:
    """What a compiler needs: the kind of grammar and its text (the cache key)."""

    kind: GrammarKind
    text: str


def _choice_ebnf(choices: list[str] | tuple[str, ...]) -> str:
    # JSON string escapes (\" \\ \n \uXXXX for control characters) are also xgrammar's EBNF
    # literal escapes; non-ASCII stays raw because the EBNF parser reads UTF-8, not \u pairs.
    return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Exactly one of:

    - `json`: a JSON schema (a dict, or its JSON text); the output is a JSON document that
      validates against it, with compact separators (", " and ": ", no free whitespace).
    - `json_object=True`: any JSON object.
    - `regex`: the output matches the regular expression (whole output).
    - `choice`: the output is exactly one of these strings.
    - `grammar`: an EBNF grammar in xgrammar's syntax (GBNF-like, `root ::= ...` is the start
      rule; e.g. `root ::= "yes" | "no"`).
    - `structural_tag`: an xgrammar structural tag, as JSON text (`{"type": "structural_tag",
      "format": ...}`): free text with constrained parts, e.g. tool calls whose arguments
      follow their schemas wherever the model starts one (`strict` tools under
      `tool_choice: "auto"`, serve/strict_tools.py).

    The output ends when the structure is complete and the model emits its end id, which the
    grammar only allows there (a request that runs out of max_tokens first ends "length").
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        given = [name for name in _GUIDES if self._is_given(name)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError(
                f"GuidedDecodingParams needs exactly one of {', '.join(_GUIDES)}; got {what}"
            )
        self._check(given[0])

    def _is_given(self, name: str) -> bool:
        value = getattr(self, name)
        return value is True if name == "json_object" else value is not None

    def _check(self, name: str) -> None:
        value = getattr(self, name)
        if name == "json":
            self._check_schema(value)
        elif name in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        elif name == "structural_tag":
            try:
                tag = _json.loads(value) if isinstance(value, str) else None
            except ValueError as exc:
                raise ValueError(f"structural_tag is not valid JSON text: {exc}") from exc
            if not isinstance(tag, dict):
                raise ValueError(
                    f"structural_tag must be the JSON text of an object, got {value!r}"
                )
        elif name == "choice":
            if not isinstance(value, list | tuple) or not value:
                raise ValueError(f"choice must be a non-empty list of str, got {value!r}")
            for item in value:
                if not isinstance(item, str) or not item:
                    raise ValueError(f"each choice must be a non-empty str, got {item!r}")

    @staticmethod
    def _check_schema(schema: Any) -> None:
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"json is not valid JSON text: {exc}") from exc
        elif isinstance(schema, dict):
            try:
                _json.dumps(schema)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"json schema is not JSON-serialisable: {exc}") from exc
        if not isinstance(schema, dict):
            raise ValueError(
                f"json must be a JSON schema object (a dict or its JSON text), got {schema!r}"
            )

    @property
    def kind(self) -> str:
        """Which guide is set: one of json, json_object, regex, choice, grammar,
        structural_tag."""
        return next(name for name in _GUIDES if self._is_given(name))

    def grammar_source(self) -> GrammarSource:
        """The grammar to compile; equal sources share one compiled grammar (the cache)."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json)
            return GrammarSource("json_schema", text)
        if self.json_object:
            return GrammarSource("json_object", '{"type": "object"}')
        if self.regex is not None:
            return GrammarSource("regex", self.regex)
        if self.choice is not None:
            return GrammarSource("ebnf", _choice_ebnf(self.choice))
        if self.structural_tag is not None:
            return GrammarSource("structural_tag", self.structural_tag)
        assert self.grammar is not None  # __post_init__: exactly one is set
        return GrammarSource("ebnf", self.grammar)
