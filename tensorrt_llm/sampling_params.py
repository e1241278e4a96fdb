"""SamplingParams: how one request decodes (length, randomness, stop conditions)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, cast

from .guided_decoding_params import GuidedDecodingParams

_MAX_SEED = 2**64 - 1
# The fields a checkpoint's generation_config.json may default (llmapi/generation_defaults.py)
# and the values they take when neither the request nor the checkpoint gives one.
DEFAULTABLE_FIELDS: dict[str, float | int] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def _is_int(value: Any) -> bool:
    # bool is an int subclass; a stray True/False is almost always a caller bug here.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_id(name: str, value: Any) -> None:
    if value is not None and (not _is_int(value) or value < 0):
        raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding knobs, validated once at construction.

    Greedy decoding is `temperature == 0` or `top_k == 1`. `top_k == 0` and `top_p == 1.0`
    switch those filters off. `end_id`/`pad_id` are normally filled from the tokenizer with
    `with_tokenizer(...)`, which returns a copy (the params object itself never changes).

    `temperature`, `top_k` and `top_p` left out (or given as None) read as 1.0, 0 and 1.0 but
    stay *unset* (`unset_fields`): the checkpoint's generation_config.json may default them
    (`with_defaults`). A value given, even the built-in one, is the caller's and always wins.
    NOTE: `dataclasses.replace` carries the unset marks over; a field it changes to another
    value becomes set (one it sets to the built-in value stays unset: pass it to the
    constructor instead).
    """

    max_tokens: int = 32
    # None (the default): unset; reads as DEFAULTABLE_FIELDS' value after construction.
    temperature: float = cast(float, None)
    top_k: int = cast(int, None)
    top_p: float = cast(float, None)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    end_id: int | None = None
    pad_id: int | None = None
    n: int = 1
    detokenize: bool = True
    _stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)
    # Which DEFAULTABLE_FIELDS the caller left out. An init field only so that
    # dataclasses.replace carries it over; never pass it yourself.
    _unset_fields: frozenset[str] | None = field(default=None, repr=False, compare=False)
    # Structured output (JSON schema, regex, choice, EBNF): guided_decoding_params.py.
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        self._resolve_unset()
        self._check_lengths()
        self._check_randomness()
        self._check_stops()
        _check_token_id("end_id", self.end_id)
        _check_token_id("pad_id", self.pad_id)
        for name in ("include_stop_str_in_output", "ignore_eos", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        # Frozen dataclass: cache the set once so the per-token stop check is O(1).
        object.__setattr__(self, "_stop_token_set", frozenset(self.stop_token_ids or ()))
        _check_guided_decoding(self.guided_decoding)

    def _resolve_unset(self) -> None:
        """Fill left-out fields with their built-in values and remember which they were."""
        carried = self._unset_fields or frozenset()
        unset = set()
        for name, builtin in DEFAULTABLE_FIELDS.items():
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, builtin)
                unset.add(name)
            elif name in carried and value == builtin and type(value) is type(builtin):
                unset.add(name)  # dataclasses.replace kept the built-in value
        object.__setattr__(self, "_unset_fields", frozenset(unset))

    @property
    def unset_fields(self) -> frozenset[str]:
        """The DEFAULTABLE_FIELDS the caller left out (their values are the built-in ones)."""
        return self._unset_fields or frozenset()

    def with_defaults(self, defaults: dict[str, float | int]) -> SamplingParams:
        """A copy with `defaults` (a subset of DEFAULTABLE_FIELDS) filling the unset fields;
        the caller's values are kept. The filled fields count as set afterwards."""
        unknown = sorted(set(defaults) - set(DEFAULTABLE_FIELDS))
        if unknown:
            raise ValueError(
                f"no generation default for {unknown}; defaultable: {sorted(DEFAULTABLE_FIELDS)}"
            )
        fill = {k: v for k, v in defaults.items() if k in self.unset_fields}
        if not fill:
            return self
        left = self.unset_fields - set(fill)
        return replace(self, **fill, _unset_fields=left)  # type: ignore[arg-type]

    def _check_lengths(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")

    def _check_randomness(self) -> None:
        temp = self.temperature
        if isinstance(temp, bool) or not isinstance(temp, int | float) or not math.isfinite(temp):
            raise ValueError(f"temperature must be a finite number, got {temp!r}")
        if temp < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temp}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        top_p = self.top_p
        if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, got {self.seed!r}")

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is not None:
            items = [stop] if isinstance(stop, str) else stop
            if not isinstance(items, list | tuple):
                raise ValueError(f"stop must be a str, a list of str or None, got {stop!r}")
            for item in items:
                if not isinstance(item, str) or not item:
                    raise ValueError(f"stop strings must be non-empty str, got {item!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list | tuple):
                raise ValueError(f"stop_token_ids must be a list of int: {self.stop_token_ids!r}")
            for tok in self.stop_token_ids:
                _check_token_id("each of stop_token_ids", tok)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (empty when unset)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stop_token_set(self) -> frozenset[int]:
        """`stop_token_ids` as a set, for O(1) checks per generated token."""
        return self._stop_token_set

    def with_tokenizer(self, tokenizer: Any) -> SamplingParams:
        """Return a copy with `end_id`/`pad_id` filled from `tokenizer` where still None.

        `pad_id` falls back to the end id, as tokenizers without a pad token expect.
        """
        end_id = self.end_id
        if end_id is None:
            end_id = getattr(tokenizer, "eos_token_id", None)
        pad_id = self.pad_id
        if pad_id is None:
            pad_id = getattr(tokenizer, "pad_token_id", None)
            if pad_id is None:
                pad_id = end_id
        return replace(self, end_id=end_id, pad_id=pad_id)


def _check_guided_decoding(value: Any) -> None:
    if value is not None and not isinstance(value, GuidedDecodingParams):
        raise ValueError(
            f"guided_decoding must be a GuidedDecodingParams or None, got {type(value).__name__}"
        )
