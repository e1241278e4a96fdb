"""SamplingParams: defaults, greedy detection, validation errors, tokenizer defaults."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from tensorrt_llm.sampling_params import SamplingParams


def test_defaults_are_sampling_with_filters_off() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p) == (32, 1.0, 0, 1.0)
    assert not p.is_greedy
    assert p.stop_strings == [] and p.stop_token_set == frozenset()


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.0, "top_k": 5}, True),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"temperature": 0.7, "top_p": 0.5}, False),
    ],
)
def test_is_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"end_id": -1}, "end_id"),
        ({"pad_id": "x"}, "pad_id"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_stop_forms_normalise() -> None:
    assert SamplingParams(stop="END").stop_strings == ["END"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop_token_ids=[3, 4, 3]).stop_token_set == frozenset({3, 4})


def test_frozen_and_replace_revalidates() -> None:
    p = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.1  # type: ignore[misc]
    q = dataclasses.replace(p, stop_token_ids=[9])
    assert q.stop_token_set == frozenset({9}) and p.stop_token_set == frozenset()
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=2.0)


def test_with_tokenizer_fills_only_missing_ids() -> None:
    tok = SimpleNamespace(eos_token_id=7, pad_token_id=None)
    p = SamplingParams().with_tokenizer(tok)
    assert (p.end_id, p.pad_id) == (7, 7)
    q = SamplingParams(end_id=3).with_tokenizer(SimpleNamespace(eos_token_id=7, pad_token_id=1))
    assert (q.end_id, q.pad_id) == (3, 1)
    base = SamplingParams()
    base.with_tokenizer(tok)
    assert base.end_id is None  # the original is untouched


@pytest.mark.parametrize(
    ("name", "value", "hint"),
    [
        ("beam_width", 4, "there is no beam search; sample n independent sequences with n"),
        ("use_beam_search", True, "no beam search"),
        ("best_of", 2, "no beam search"),
        ("length_penalty", 1.2, "no beam search"),
        ("return_context_logits", True, "ask for logprobs / prompt_logprobs"),
        ("return_generation_logits", True, "ask for logprobs / prompt_logprobs"),
        ("exclude_input_from_output", False, "outputs never include the prompt"),
        ("bad", ["x"], "use bad_words"),
        ("add_special_tokens", False, "give prompt_token_ids"),
        ("truncate_prompt_tokens", 8, "prompts are never truncated"),
    ],
)
def test_upstream_only_arguments_say_what_to_use(name: str, value: object, hint: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\({name}=\.\.\.\) is not supported") as e:
        SamplingParams(**{name: value})
    assert hint in str(e.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]


def test_sampling_params_still_copy_and_pickle() -> None:
    import copy
    import pickle

    params = SamplingParams(max_tokens=3, temperature=0.5, stop=["x"])
    assert pickle.loads(pickle.dumps(params)) == params == copy.deepcopy(params)
    assert dataclasses.replace(params, max_tokens=4).max_tokens == 4
