"""The checkpoint's generation_config.json as per-request sampling defaults.

`LLM(..., generation_config="auto")` (the default) reads the file once; a request that leaves
one of `DEFAULTABLE_FIELDS` unset (`SamplingParams.unset_fields`: temperature, top_p, top_k,
min_p, repetition/presence/frequency penalties) takes the checkpoint's value, and its eos ids
stop generation beside the tokenizer's end id (as in HF `generate`), unless the request gives
its own `end_id` or `ignore_eos`. A value the request gives always
wins. `"ignore"` reads nothing: the built-in defaults and the tokenizer's end id only.

`do_sample: false` means greedy (HF's meaning): a request without a temperature then decodes
greedily; its top_p/top_k defaults still apply when the request asks for sampling with a
temperature of its own. A file without `do_sample` is not read as greedy (HF's implicit
default), so a file that only lists eos ids changes nothing but the stops. Fields the sampler
does not implement (typical_p, no_repeat_ngram_size, beams, ...) are never silently dropped: a
non-neutral value is named in the startup log as not applied.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..sampling_params import DEFAULTABLE_FIELDS, SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "ignore")
# Fields HF generation configs carry that requests do not take from the file, with their
# neutral values (a checkpoint setting one to anything else is logged as not applied) and why.
_SAMPLER_LACKS = "the sampler does not implement it yet"
_NOT_APPLIED: dict[str, tuple[Any, str]] = {
    "typical_p": (1.0, _SAMPLER_LACKS),
    "no_repeat_ngram_size": (0, _SAMPLER_LACKS),
    "num_beams": (1, "there is no beam search"),
    "max_new_tokens": (
        None,
        "a request's max_tokens defaults to SamplingParams' 32 (LLM) or --default_max_tokens "
        "(trtllm-serve)",
    ),
}


def read_generation_config(model_dir: str) -> dict[str, Any] | None:
    """The parsed generation_config.json of `model_dir`, or None when there is none.

    A file that exists but is not a JSON object is an error (never silently skipped)."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path} is not readable JSON ({exc}); fix it or pass generation_config='ignore'"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"{path} must hold a JSON object, got {type(raw).__name__}; fix it or pass "
            "generation_config='ignore'"
        )
    return raw


def _eos_ids(value: Any, path: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, list) or not all(
        isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in items
    ):
        raise ValueError(
            f"{path}: eos_token_id must be a non-negative int or a list of them, got {value!r}"
        )
    return tuple(dict.fromkeys(items))  # de-duplicated, order kept


@dataclass(frozen=True)
class GenerationDefaults:
    """What generation_config.json contributes to requests (empty: nothing)."""

    # Values for the unset SamplingParams fields (a subset of DEFAULTABLE_FIELDS).
    sampling: dict[str, float | int] = field(default_factory=dict)
    # End ids that stop a request with the default end id (beside the tokenizer's).
    eos_token_ids: tuple[int, ...] = ()
    # (field, value) pairs the checkpoint sets but the sampler cannot apply.
    not_applied: tuple[tuple[str, Any], ...] = ()
    # The file read (None: no file, or generation_config="ignore").
    source: str | None = None
    # do_sample=false: an unset temperature is 0 (greedy).
    greedy: bool = False

    @classmethod
    def from_checkpoint(cls, model_dir: str, mode: str = "auto") -> GenerationDefaults:
        if mode not in GENERATION_CONFIG_MODES:
            raise ValueError(
                f"generation_config must be one of {list(GENERATION_CONFIG_MODES)}, got {mode!r}"
            )
        if mode == "ignore":
            return cls()
        raw = read_generation_config(model_dir)
        if raw is None:
            return cls()
        return cls.from_dict(raw, str(Path(model_dir) / GENERATION_CONFIG_FILE))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> GenerationDefaults:
        """Defaults from a parsed generation config; bad values raise naming `source`."""
        sampling: dict[str, float | int] = {
            name: raw[name] for name in DEFAULTABLE_FIELDS if raw.get(name) is not None
        }
        do_sample = raw.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ValueError(f"{source}: do_sample must be a bool, got {do_sample!r}")
        if do_sample is False:
            sampling["temperature"] = 0.0  # greedy, whatever temperature the file also gives
        try:
            SamplingParams(**sampling)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(
                f"{source}: {exc}; fix it or pass generation_config='ignore'"
            ) from None
        not_applied = tuple(
            (name, raw[name])
            for name, (neutral, _why) in _NOT_APPLIED.items()
            if raw.get(name) is not None and raw[name] != neutral
        )
        eos = _eos_ids(raw.get("eos_token_id"), source)
        return cls(sampling, eos, not_applied, source, greedy=do_sample is False)

    def apply(self, sp: SamplingParams) -> SamplingParams:
        """`sp` with the checkpoint's values in the fields the request left unset."""
        return sp.with_defaults(self.sampling) if self.sampling else sp

    def describe(self) -> str:
        """One line: what requests that leave fields unset get."""
        if self.source is None:
            return "generation defaults: none (built-in sampling defaults, tokenizer end id)"
        parts = [f"{k}={v}" for k, v in sorted(self.sampling.items())]
        if self.greedy:
            parts.append("greedy (do_sample=false)")
        if self.eos_token_ids:
            parts.append(f"eos_token_id={list(self.eos_token_ids)}")
        applied = ", ".join(parts) or "nothing"
        return f"generation defaults from {self.source}: {applied}"

    def log_startup(self) -> None:
        """The startup log: the defaults applied, then each field that is not (a warning)."""
        logger.info(
            "%s (a request's own value wins; generation_config='ignore' drops them)",
            self.describe(),
        )
        for name, value in self.not_applied:
            logger.warning(
                "generation_config.json sets %s=%r, which is NOT applied: %s",
                name,
                value,
                _NOT_APPLIED[name][1],
            )
