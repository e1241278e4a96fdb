"""generation_config.json defaults end to end: what the engine receives and generates (CPU).

A request that leaves temperature/top_p/top_k unset takes the checkpoint's; one that gives them
keeps its own; generation_config="ignore" takes neither; the checkpoint's eos ids stop
generation; process mode applies the same defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

KWARGS: dict[str, Any] = dict(
    device="cpu", max_batch_size=4, max_num_tokens=128, max_seq_len=128, tokens_per_block=16
)
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
SEEDS = (1, 2, 3)
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def sampling_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        "qwen2", tmp_path_factory.mktemp("sampling"), generation_config=SAMPLING
    )


@pytest.fixture(scope="module")
def greedy_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        "qwen2", tmp_path_factory.mktemp("greedy"), generation_config={"do_sample": False}
    )


def _received(llm: LLM) -> list[SamplingParams]:
    """Record the SamplingParams of every request the (in-process) engine is handed."""
    seen: list[SamplingParams] = []
    enqueue = llm._executor.enqueue_request

    def spy(request: Any, callback: Any = None) -> Any:
        seen.append(request.sampling_params)
        return enqueue(request, callback)

    llm._executor.enqueue_request = spy
    return seen


def _tokens(llm: LLM, **params: Any) -> list[int]:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, **params))
    return list(out.outputs[0].token_ids)


def test_unset_fields_take_the_checkpoints_values(sampling_ckpt: Path) -> None:
    with LLM(str(sampling_ckpt), executor_mode="inproc", **KWARGS) as llm:
        seen = _received(llm)
        llm.generate(PROMPT, SamplingParams(max_tokens=2))
        llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.2, top_k=0))
    (default, own) = seen
    assert (default.temperature, default.top_p, default.top_k) == (0.6, 0.95, 20)
    assert (own.temperature, own.top_p, own.top_k) == (0.2, 0.95, 0)  # explicit values win


def test_do_sample_false_is_greedy_and_ignore_samples(greedy_ckpt: Path) -> None:
    with LLM(str(greedy_ckpt), executor_mode="inproc", **KWARGS) as llm:
        greedy = _tokens(llm, temperature=0.0)
        unset = [_tokens(llm, seed=s) for s in SEEDS]
        hot = [_tokens(llm, seed=s, temperature=1.0) for s in SEEDS]
    assert unset == [greedy] * len(SEEDS)  # no temperature given: the checkpoint's greedy
    assert len({tuple(t) for t in hot}) > 1  # an explicit temperature samples
    with LLM(str(greedy_ckpt), executor_mode="inproc", generation_config="ignore", **KWARGS) as llm:
        ignored = [_tokens(llm, seed=s) for s in SEEDS]
    assert ignored == hot  # the built-in temperature 1.0, same seeds, same samples


def test_generation_config_eos_ids_stop_generation(tmp_path: Path, greedy_ckpt: Path) -> None:
    with LLM(str(greedy_ckpt), executor_mode="inproc", **KWARGS) as llm:
        free = _tokens(llm, temperature=1.0, seed=5)
    # A token of a seeded run that does not occur before it becomes the checkpoint's eos.
    at = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    ckpt = write_tiny_checkpoint(
        "qwen2", tmp_path, generation_config={"do_sample": False, "eos_token_id": [free[at]]}
    )
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    with LLM(str(ckpt), executor_mode="inproc", **KWARGS) as llm:
        out = llm.generate(PROMPT, params).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == free[at]
    assert list(out.token_ids)[:at] == free[:at] and len(out.token_ids) <= at + 1
    with LLM(str(ckpt), executor_mode="inproc", generation_config="ignore", **KWARGS) as llm:
        ignored = llm.generate(PROMPT, params).outputs[0]
    assert len(ignored.token_ids) > at + 1  # the checkpoint's eos ids are not read


def test_process_mode_applies_the_same_defaults(sampling_ckpt: Path) -> None:
    with LLM(str(sampling_ckpt), executor_mode="inproc", **KWARGS) as inproc:
        want = [_tokens(inproc, seed=s) for s in SEEDS]
    with LLM(str(sampling_ckpt), executor_mode="process", **KWARGS) as proc:
        sp = proc.prepare(PROMPT).sampling_params
        got = [_tokens(proc, seed=s) for s in SEEDS]
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.95, 20)
    assert got == want
