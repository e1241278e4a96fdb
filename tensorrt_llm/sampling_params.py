"""SamplingParams: how one request decodes (length, randomness, stop conditions)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, cast

from .guided_decoding_params import GuidedDecodingParams
from .sampling_params_upstream import check_upstream_kwargs

_MAX_SEED = 2**64 - 1
# The fields a checkpoint's generation_config.json may default (llmapi/generation_defaults.py)
# and the values they take when neither the request nor the checkpoint gives one.
DEFAULTABLE_FIELDS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
# OpenAI's (and vLLM's) bounds of the two additive penalties.
_MAX_ADDITIVE_PENALTY = 2.0
# The most top alternatives a token's logprobs may carry (OpenAI's top_logprobs bound, vLLM's
# default max_logprobs): the device top-k and the host payload stay small.
MAX_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    # bool is an int subclass; a stray True/False is almost always a caller bug here.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_token_id(name: str, value: Any) -> None:
    if value is not None and (not _is_int(value) or value < 0):
        raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")


def _bad_word_ids(tokenizer: Any, word: str) -> list[list[int]]:
    """The token sequences that spell `word`, as vLLM bans them: the word alone, plus the
    word after a space when that is another token sequence of the same length (the form it
    takes inside a text with tokenizers that fold the space into the token)."""
    bare = word.lstrip()
    plain = list(tokenizer.encode(bare, add_special_tokens=False))
    spaced = list(tokenizer.encode(" " + bare, add_special_tokens=False))
    if not plain:
        raise ValueError(f"bad word {word!r} tokenizes to no tokens")
    out = [plain]
    if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
        out.append(spaced)
    return out


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding knobs, validated once at construction.

    Greedy decoding is `temperature == 0` or `top_k == 1`. `top_k == 0` and `top_p == 1.0`
    switch those filters off. `end_id`/`pad_id` are normally filled from the tokenizer with
    `with_tokenizer(...)`, which returns a copy (the params object itself never changes).

    Logit processing (sampler_penalties.py, applied to greedy requests too), in this order:
    `logit_bias` (token id -> added to its logit), `bad_words` (each word's token sequences,
    filled by `with_tokenizer`: a sequence's last token is banned when the output ends with
    the rest of it; one-token words are always banned), `min_tokens` (the end id, unless
    `ignore_eos`, and `stop_token_ids` are banned until that many tokens are generated), then
    on the raw logits `repetition_penalty` (HF: a logit of a token seen in prompt or output is
    divided by it when positive, multiplied when not), `presence_penalty` / `frequency_penalty`
    (OpenAI/vLLM: over the OUTPUT tokens only, minus penalty once / per occurrence), then
    temperature, then `min_p` (vLLM: drop tokens whose probability is below min_p times the
    top one), top-k and top-p. There is no beam search (no `use_beam_search` / `best_of`).

    The DEFAULTABLE_FIELDS (`temperature`, `top_k`, `top_p`, `min_p` and the three penalties)
    left out (or given as None) read as their neutral values but stay *unset*
    (`unset_fields`): the checkpoint's generation_config.json may default them
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
    min_p: float = cast(float, None)
    repetition_penalty: float = cast(float, None)
    presence_penalty: float = cast(float, None)
    frequency_penalty: float = cast(float, None)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    end_id: int | None = None
    pad_id: int | None = None
    n: int = 1
    detokenize: bool = True
    # Text without the tokenizer's special tokens (<|im_end|>, ...), as vLLM and TensorRT-LLM
    # default; False keeps them. `spaces_between_special_tokens` reaches the tokenizer's decode
    # (slow tokenizers put a space around special tokens; fast ones never do).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    priority: int = 0
    # vLLM's prompt_logprobs: per prompt position >= 1, that token's logprob given the ones
    # before it plus the k most likely (pyexecutor/prompt_logprobs.py); position 0 has none.
    prompt_logprobs: int | None = None
    _stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)
    # True when the sampler must process this request's logits (sampler_penalties.py).
    _needs_processing: bool = field(init=False, repr=False, compare=False)
    # (the bad_words they came from, their token sequences), set by with_tokenizer. An init
    # field so that replace and pickle carry it; dropped when bad_words changed since.
    _bad_words_ids: tuple[tuple[str, ...], tuple[tuple[int, ...], ...]] | None = field(
        default=None, repr=False, compare=False
    )
    # Which DEFAULTABLE_FIELDS the caller left out. An init field only so that
    # dataclasses.replace carries it over; never pass it yourself.
    _unset_fields: frozenset[str] | None = field(default=None, repr=False, compare=False)
    # Structured output (JSON schema, regex, choice, EBNF): guided_decoding_params.py.
    guided_decoding: GuidedDecodingParams | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        # NOTE: runs before the generated __init__, whose TypeError for an unknown keyword
        # would not say what to use instead of an upstream argument.
        check_upstream_kwargs(kwargs)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self._resolve_unset()
        self._check_lengths()
        self._check_randomness()
        self._check_penalties()
        self._check_stops()
        self._check_logit_filters()
        _check_token_id("end_id", self.end_id)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        _check_token_id("pad_id", self.pad_id)
        for name in (
            "include_stop_str_in_output", "ignore_eos", "detokenize", "skip_special_tokens",
            "spaces_between_special_tokens",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        # Frozen dataclass: cache the set once so the per-token stop check is O(1).
        object.__setattr__(self, "_stop_token_set", frozenset(self.stop_token_ids or ()))
        object.__setattr__(self, "_needs_processing", self._uses_logit_processing())
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
        if not _is_int(self.priority):
            raise ValueError(f"priority must be an int, got {self.priority!r}")

    def _check_penalties(self) -> None:
        rep = self.repetition_penalty
        if not _is_number(rep) or rep <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 disables it), got {rep!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or abs(value) > _MAX_ADDITIVE_PENALTY:
                raise ValueError(
                    f"{name} must be a number in [-2, 2] (0 disables it), got {value!r}"
                )
        min_p = self.min_p
        if not _is_number(min_p) or not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {min_p!r}")

    def _check_logit_filters(self) -> None:
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> float, got {bias!r}")
            for tok, value in bias.items():
                _check_token_id("each logit_bias key", tok)
                if not _is_number(value):
                    raise ValueError(f"logit_bias[{tok}] must be a finite number, got {value!r}")
        words = self.bad_words
        if words is not None:
            if not isinstance(words, list | tuple):
                raise ValueError(f"bad_words must be a list of str or None, got {words!r}")
            for word in words:
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"each of bad_words must be a non-blank str, got {word!r}")
        ids = self._bad_words_ids
        if ids is not None and ids[0] != tuple(words or ()):
            object.__setattr__(self, "_bad_words_ids", None)  # stale: bad_words changed

    def _uses_logit_processing(self) -> bool:
        # min_p is not here: it belongs to the sampling stage, beside top-k/top-p. Nor is
        # min_tokens: it only matters until that many tokens exist (the sampler checks it).
        return bool(self.logit_bias or self.bad_words or self.uses_penalties)

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
    def uses_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty is on (token counts needed)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_logit_processing(self) -> bool:
        """True when a processor before temperature is on for the request's whole life (bias,
        bad words, penalties); computed once, for the sampler's per-step fast check."""
        return self._needs_processing

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...] | None:
        """The token sequences of `bad_words` (None until `with_tokenizer` filled them)."""
        return None if self._bad_words_ids is None else self._bad_words_ids[1]

    def why_not_in_vocab(self, vocab_size: int) -> str | None:
        """Why the token ids this request names (logit_bias keys, stop_token_ids, bad word
        tokens) do not fit a vocabulary of `vocab_size`, or None. Run where the vocabulary is
        known: the LLM front end (a ValueError for the caller) and the executor (that request
        fails)."""
        problem = self.vocab_problem(vocab_size)
        return None if problem is None else problem[1]

    def vocab_problem(self, vocab_size: int) -> tuple[str, str] | None:
        """(the field, why) for `why_not_in_vocab`; the field names the error's `param`."""
        bias = [t for t in (self.logit_bias or {}) if t >= vocab_size]
        if bias:
            return "logit_bias", (
                f"logit_bias names token ids {sorted(bias)[:8]} outside the vocab [0, {vocab_size})"
            )
        # A stop id the model can never sample would silently never stop the request.
        stops = [t for t in self.stop_token_ids or () if t >= vocab_size]
        if stops:
            return "stop_token_ids", (
                f"stop_token_ids names token ids {sorted(stops)[:8]} outside the vocab "
                f"[0, {vocab_size})"
            )
        if self.bad_words and self.bad_words_token_ids is None:
            return "bad_words", "bad_words were never tokenized (SamplingParams.with_tokenizer)"
        bad = {t for seq in self.bad_words_token_ids or () for t in seq if t >= vocab_size}
        if bad:
            return "bad_words", (
                f"bad_words tokenize to ids {sorted(bad)[:8]} outside the vocab [0, {vocab_size})"
            )
        return None

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
        """Return a copy with `end_id`/`pad_id` filled from `tokenizer` where still None, and
        the token sequences of `bad_words` (`bad_words_token_ids`) where not filled yet.

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
        bad_ids = self._bad_words_ids
        if self.bad_words and bad_ids is None:
            if tokenizer is None or not hasattr(tokenizer, "encode"):
                raise ValueError("bad_words need a tokenizer to be turned into token ids")
            words = tuple(self.bad_words)
            seqs = [tuple(seq) for word in words for seq in _bad_word_ids(tokenizer, word)]
            bad_ids = (words, tuple(seqs))
        return replace(self, end_id=end_id, pad_id=pad_id, _bad_words_ids=bad_ids)


def _check_guided_decoding(value: Any) -> None:
    if value is not None and not isinstance(value, GuidedDecodingParams):
        raise ValueError(
            f"guided_decoding must be a GuidedDecodingParams or None, got {type(value).__name__}"
        )
