"""generation_config.json defaults: parsing, unset vs set fields, what the front end applies.

Engine-free: GenerationDefaults and SamplingParams directly, and an InputPreparer built from
LlmArgs alone (what a preprocess worker does) on a tiny checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
from pathlib import Path

import pytest

from tensorrt_llm import SamplingParams
from tensorrt_llm.inputs.registry import create_input_processor, load_tokenizer
from tensorrt_llm.llmapi.generation_defaults import GenerationDefaults
from tensorrt_llm.llmapi.input_preparer import InputPreparer
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.sampling_params import DEFAULTABLE_FIELDS
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

QWEN3_6 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen_defaults")
    return write_tiny_checkpoint("qwen2", out, generation_config={**QWEN3_6, "eos_token_id": 7})


def _preparer(ckpt: Path, mode: str = "auto") -> InputPreparer:
    args = LlmArgs(model=str(ckpt), device="cpu", generation_config=mode)
    tok = load_tokenizer(str(ckpt))
    return InputPreparer(args, tok, create_input_processor(str(ckpt), tokenizer=tok), 256)


# ---- SamplingParams: unset is not "set to the default value" --------------------------------
def test_unset_fields_read_as_the_builtin_values() -> None:
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p) == (1.0, 0, 1.0)
    assert sp.unset_fields == set(DEFAULTABLE_FIELDS)
    assert (sp.min_p, sp.repetition_penalty, sp.presence_penalty) == (0.0, 1.0, 0.0)
    given = SamplingParams(temperature=1.0, top_k=0)
    assert "top_p" in given.unset_fields  # the built-in value, but the caller's
    assert not given.unset_fields & {"temperature", "top_k"}
    assert SamplingParams(temperature=None).unset_fields >= {"temperature"}  # type: ignore[arg-type]


def test_defaults_fill_only_unset_fields_and_survive_replace_and_pickle() -> None:
    sp = dataclasses.replace(SamplingParams(top_p=0.5), max_tokens=3)
    assert sp.unset_fields == set(DEFAULTABLE_FIELDS) - {"top_p"}  # replace keeps the marks
    filled = sp.with_defaults({"temperature": 0.6, "top_k": 20, "top_p": 0.95})
    assert (filled.temperature, filled.top_k, filled.top_p) == (0.6, 20, 0.5)
    assert not filled.unset_fields & {"temperature", "top_k", "top_p"} and filled.max_tokens == 3
    assert filled.with_defaults({"temperature": 0.1}) is filled  # nothing unset any more
    assert pickle.loads(pickle.dumps(sp)).unset_fields == sp.unset_fields  # process mode
    changed = dataclasses.replace(SamplingParams(), temperature=0.3)
    assert "temperature" not in changed.unset_fields
    with pytest.raises(ValueError, match="seed"):
        SamplingParams().with_defaults({"seed": 1})


# ---- parsing generation_config.json ---------------------------------------------------------
def test_sampling_fields_and_eos_ids_are_read() -> None:
    d = GenerationDefaults.from_dict({**QWEN3_6, "eos_token_id": [5, 9, 5]}, "g.json")
    assert d.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert d.eos_token_ids == (5, 9) and not d.greedy
    assert GenerationDefaults.from_dict({"eos_token_id": 4}, "g.json").eos_token_ids == (4,)
    only_eos = GenerationDefaults.from_dict({"eos_token_id": 4}, "g.json")
    assert only_eos.sampling == {}  # no do_sample: not HF's implicit greedy


def test_do_sample_false_means_greedy() -> None:
    d = GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.7, "top_k": 3}, "g")
    assert d.greedy and d.sampling == {"temperature": 0.0, "top_k": 3}
    sp = d.apply(SamplingParams())
    assert sp.is_greedy
    # A request that asks for sampling still gets the checkpoint's top_k.
    hot = d.apply(SamplingParams(temperature=0.8))
    assert not hot.is_greedy and hot.temperature == 0.8 and hot.top_k == 3


@pytest.mark.parametrize(
    ("raw", "word"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"do_sample": "yes"}, "do_sample"),
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"eos_token_id": [1, -1]}, "eos_token_id"),
    ],
)
def test_bad_values_fail_naming_the_file_and_field(raw: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word) as info:
        GenerationDefaults.from_dict(raw, "/ckpt/generation_config.json")
    assert "/ckpt/generation_config.json" in str(info.value)


def test_unreadable_file_is_an_error_and_ignore_skips_it(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="generation_config='ignore'"):
        GenerationDefaults.from_checkpoint(str(tmp_path))
    assert GenerationDefaults.from_checkpoint(str(tmp_path), "ignore") == GenerationDefaults()
    assert GenerationDefaults.from_checkpoint(str(tmp_path / "none")) == GenerationDefaults()
    with pytest.raises(ValueError, match="generation_config must be one of"):
        GenerationDefaults.from_checkpoint(str(tmp_path), "vllm")


def test_unsupported_fields_are_logged_not_dropped(caplog: pytest.LogCaptureFixture) -> None:
    raw = {**QWEN3_6, "typical_p": 0.9, "no_repeat_ngram_size": 0}
    d = GenerationDefaults.from_dict({**raw, "max_new_tokens": 2048}, "g.json")
    # no_repeat_ngram_size 0 is neutral: nothing to say about it.
    assert d.not_applied == (("typical_p", 0.9), ("max_new_tokens", 2048))
    with caplog.at_level(logging.INFO, logger="tensorrt_llm.llmapi.generation_defaults"):
        d.log_startup()
    text = caplog.text
    assert "temperature=0.6" in text and "top_k=20" in text and "top_p=0.95" in text
    assert "typical_p=0.9, which is NOT applied" in text
    assert "no_repeat_ngram_size" not in text
    assert "max_new_tokens=2048, which is NOT applied: a request's max_tokens" in text


def test_penalties_and_min_p_are_defaults_of_unset_fields() -> None:
    raw = {**QWEN3_6, "repetition_penalty": 1.05, "presence_penalty": 1.5, "min_p": 0.1}
    d = GenerationDefaults.from_dict(raw, "g.json")
    assert d.not_applied == ()
    sp = d.apply(SamplingParams(presence_penalty=0.0))
    assert (sp.repetition_penalty, sp.min_p, sp.frequency_penalty) == (1.05, 0.1, 0.0)
    assert sp.presence_penalty == 0.0  # the request's own value, even the neutral one, wins
    assert sp.needs_logit_processing and sp.unset_fields == {"frequency_penalty"}
    with pytest.raises(ValueError, match="g.json: repetition_penalty"):
        GenerationDefaults.from_dict({"repetition_penalty": 0.0}, "g.json")


# ---- the front end's preparation --------------------------------------------------------------
def test_preparer_applies_the_checkpoint_defaults(ckpt: Path) -> None:
    prep = _preparer(ckpt)
    sp = prep.prepare("hello", None).sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.95, 20)
    assert 7 in {sp.end_id, *(sp.stop_token_ids or [])}  # the checkpoint's eos id stops
    own = prep.prepare("hello", SamplingParams(temperature=1.0, top_k=0)).sampling_params
    assert (own.temperature, own.top_p, own.top_k) == (1.0, 0.95, 0)  # the request's win
    assert not prep.prepare("hi", SamplingParams(ignore_eos=True)).sampling_params.stop_token_ids


def test_ignore_keeps_the_builtin_defaults(ckpt: Path) -> None:
    sp = _preparer(ckpt, "ignore").prepare("hello", None).sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k) == (1.0, 1.0, 0)
    assert 7 not in {sp.end_id, *(sp.stop_token_ids or [])}


def test_tiny_checkpoint_writes_the_generation_config(tmp_path: Path) -> None:
    out = write_tiny_checkpoint(
        "qwen2", tmp_path, generation_config={"top_k": 4, "do_sample": None}
    )
    raw = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))
    assert raw["top_k"] == 4 and "do_sample" not in raw and "eos_token_id" in raw
