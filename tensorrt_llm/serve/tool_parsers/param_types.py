"""Typing the text of an XML tool-call parameter by the tool's JSON schema (qwen3_coder).

The XML form writes every value as bare text, so `3`, `true` and `{"a": 1}` only become a
number, a boolean and an object through the schema of the parameter. Rules (vLLM's
Qwen3CoderToolParser._convert_param_value, with the differences marked):
- no schema for the parameter (function or parameter not in `tools`): the text as a string;
- `string` (or no `type`): the text as is, whitespace included;
- `null` (any case) for a parameter whose types are not only `string` -> null. vLLM turns `null`
  into null for strings too; a string parameter can legitimately say "null";
- `integer`: an integer literal, `number`: any finite float literal (an integral value stays an
  int: `3` -> 3, but `3.0` stays 3.0 where vLLM gives 3);
- `boolean`: `true`/`false` in any case; anything else stays a string (vLLM gives false);
- `object` / `array`: JSON, then a Python literal (models write `{'a': True}` too, vLLM does
  the same), kept only when it is of the declared kind and serialisable, else the string;
- other or unknown types: JSON when the whole text is JSON, else the string;
- a list of types or `anyOf` / `oneOf`: each non-string type in that order, then string.
A value that fails its type is never an error: the text goes through as a string and the
client's own validation can say what is wrong.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from typing import Any

_INT = re.compile(r"[+-]?\d+")
_FAILED = object()  # a conversion that does not apply (None is a valid result: JSON null)


def schema_types(schema: Any) -> list[str]:
    """The declared JSON types of a parameter schema, in order, lower case."""
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared.strip().lower()]
    if isinstance(declared, list):
        return [str(t).strip().lower() for t in declared]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            out += [t for t in schema_types(sub) if t not in out]
    return out


def convert_param_value(text: str, schema: Any) -> Any:
    """The JSON value of one parameter's text under its schema (None: no schema)."""
    if schema is None:
        return text
    types = schema_types(schema)
    if not types:
        return text
    if text.strip().lower() == "null" and types != ["string"]:
        return None
    for kind in types:
        if kind in ("string", "null"):
            continue
        value = _convert(text.strip(), kind)
        if value is not _FAILED:
            return value
    return text


def _convert(text: str, kind: str) -> Any:
    if kind == "integer":
        return int(text) if _INT.fullmatch(text) else _FAILED
    if kind == "number":
        if _INT.fullmatch(text):
            return int(text)
        try:
            number = float(text)
        except ValueError:
            return _FAILED
        return number if math.isfinite(number) else _FAILED
    if kind == "boolean":
        lowered = text.lower()
        return lowered == "true" if lowered in ("true", "false") else _FAILED
    if kind in ("object", "array"):
        wanted = dict if kind == "object" else list
        value = _loads(text)
        if value is _FAILED:
            value = _literal(text)
        return value if isinstance(value, wanted) else _FAILED
    return _loads(text)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is no JSON")


def strict_json_loads(text: str) -> Any:
    """json.loads without NaN / Infinity (Python reads them, JSON has none: the arguments
    string must stay valid for any client); too deep a nesting is a ValueError too."""
    try:
        return json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _loads(text: str) -> Any:
    try:
        return strict_json_loads(text)
    except ValueError:
        return _FAILED


def _literal(text: str) -> Any:
    """A Python literal that JSON can carry (sets, bytes, complex numbers fail here)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _FAILED
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return _FAILED
    return value
