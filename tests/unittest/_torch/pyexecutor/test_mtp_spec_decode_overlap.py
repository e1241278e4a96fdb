"""MTP speculative decoding with the overlap scheduler (OverlapPyExecutor, the default).

Greedy outputs equal the non-speculative run's token for token; seeded temperature outputs
equal MTP without the overlap scheduler; streaming has no repeated or missing token; requests
finish at different steps (max_tokens, stop tokens inside accepted runs); the longer prompts
are prefilled in chunks (max_num_tokens 16); preemption under KV pressure. The previous step's
streaming responses are sent while the next verify step runs, before its results reach the host.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_overlap import OverlapPyExecutor
from tensorrt_llm._torch.pyexecutor.spec_decode.spec_decoder import SpecDecoder
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe")
K = 3
VOCAB = 512  # the tiny configs' vocab_size
# max_num_tokens 16 < the 23-token prompt: chunked prefill beside verify rows.
ENGINE = {"executor_mode": "inproc", "max_num_tokens": 16, "tokens_per_block": 4,
          "max_batch_size": 4}  # fmt: skip
MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": K}
PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((7, 23, 3, 11))]
MAX_TOKENS = (13, 9, 17, 6)
Override = Callable[[LlmRequest, list[int]], list[int]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = Path(tmp_path_factory.mktemp("mtp_overlap"))
    return {f: write_tiny_checkpoint(f, root / f, mtp_num_hidden_layers=1) for f in FAMILIES}


def _params(stop: dict[int, list[int]] | None = None) -> list[SamplingParams]:
    stop = stop or {}
    return [
        SamplingParams(max_tokens=n, temperature=0, stop_token_ids=stop.get(i))
        for i, n in enumerate(MAX_TOKENS)
    ]


def _generate(
    ckpt: Path,
    params: list[SamplingParams],
    spec: dict[str, Any] | None = None,
    override: Override | None = None,
    overlap: bool = True,
) -> list[list[int]]:
    with LLM(
        model=str(ckpt), speculative_config=spec, disable_overlap_scheduler=not overlap, **ENGINE
    ) as llm:
        assert isinstance(llm._executor, OverlapPyExecutor) == overlap
        if spec is not None:
            llm._executor.spec_decoder.draft_override = override
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _continuation(reference: list[list[int]], correct: Callable[[int], int]) -> Override:
    """Drafts from the reference's continuation: `correct(num_generated)` right, then wrong."""
    by_prompt = {tuple(p): out for p, out in zip(PROMPTS, reference, strict=True)}

    def override(req: LlmRequest, drafts: list[int]) -> list[int]:
        cont = by_prompt[tuple(int(t) for t in req.prompt_token_array)]
        done = req.num_generated_tokens
        good = correct(done)
        out = []
        for j in range(len(drafts)):
            want = cont[done + j] if done + j < len(cont) else 0
            out.append(want if j < good else (want + 1) % VOCAB)
        return out

    return override


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_non_speculative(family: str, ckpts: dict[str, Path]) -> None:
    """The head's own drafts and partly accepted ones (rollback; each step a different count
    accepted, so the next step's rows depend on the previous step's results)."""
    reference = _generate(ckpts[family], _params())
    assert _generate(ckpts[family], _params(), overlap=False) == reference
    assert _generate(ckpts[family], _params(), MTP) == reference
    partly = _continuation(reference, lambda done: done % (K + 1))
    assert _generate(ckpts[family], _params(), MTP, partly) == reference


def test_requests_finish_at_different_steps(ckpts: dict[str, Path]) -> None:
    """Oracle drafts (runs of 1 + K) with stop tokens and max_tokens landing inside runs."""
    ckpt = ckpts["qwen3_5"]
    reference = _generate(ckpt, _params())
    stop = {0: [reference[0][5]], 2: [reference[2][10]]}
    expected = _generate(ckpt, _params(stop), overlap=False)
    assert len(expected[0]) < len(reference[0]) and len(expected[2]) < len(reference[2])
    oracle = _continuation(reference, lambda _: K)
    assert _generate(ckpt, _params(stop), MTP, oracle) == expected


def test_seeded_sampling_equals_mtp_without_overlap(ckpts: dict[str, Path]) -> None:
    ckpt = ckpts["qwen3_5"]
    reference = _generate(ckpt, _params())
    params = _params()
    for i in (1, 2):
        params[i] = SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.9, seed=3 + i)
    params[3] = SamplingParams(max_tokens=MAX_TOKENS[3], temperature=0.8, top_p=0.9, seed=1)
    oracle = _continuation(reference, lambda _: K)
    want = _generate(ckpt, params, MTP, oracle, overlap=False)
    assert _generate(ckpt, params, MTP, oracle) == want
    assert want[0] == reference[0]


def test_streaming_has_no_repeats_or_gaps_and_overlaps(
    ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed diffs reassemble to the batch output; responses held back from a step go out
    inside the next step, before its results are copied to the host."""
    ckpt = ckpts["qwen3_5_moe"]
    reference = _generate(ckpt, _params())
    inside: list[int] = []  # requests sent per `_send_unsent` call made within a step
    running = [False]
    run_step, send = SpecDecoder.run_step, OverlapPyExecutor._send_unsent

    def wrapped_run(self: SpecDecoder, *args: Any, **kwargs: Any) -> None:
        running[0] = True
        try:
            run_step(self, *args, **kwargs)
        finally:
            running[0] = False

    def wrapped_send(self: OverlapPyExecutor) -> None:
        if running[0]:
            inside.append(len(self._unsent))
        send(self)

    monkeypatch.setattr(SpecDecoder, "run_step", wrapped_run)
    monkeypatch.setattr(OverlapPyExecutor, "_send_unsent", wrapped_send)
    partly = _continuation(reference, lambda done: done % (K + 1))
    with LLM(model=str(ckpt), speculative_config=MTP, **ENGINE) as llm:
        llm._executor.spec_decoder.draft_override = partly
        params = _params()
        handles = [
            llm.generate_async({"prompt_token_ids": p}, sp, streaming=True)
            for p, sp in zip(PROMPTS, params, strict=True)
        ]
        # NOTE: the front end merges the updates a late reader has not taken yet.
        parts = [[list(part.outputs[0].token_ids_diff) for part in h] for h in handles]
    assert [[t for diff in p for t in diff] for p in parts] == reference
    assert len(parts[0]) > 1  # really streamed, read while running
    assert sum(inside) > 0


def test_preemption_under_kv_pressure_keeps_greedy_output(ckpts: dict[str, Path]) -> None:
    """Requests preempted and prefilled again while their last step's response is held back."""
    ckpt = ckpts["qwen3_5"]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True) for _ in PROMPTS]
    small = {**ENGINE, "kv_cache_config": {"max_tokens": 96}}

    def run(spec: dict[str, Any] | None, oracle: Override | None = None) -> tuple[Any, int]:
        with LLM(model=str(ckpt), speculative_config=spec, **small) as llm:
            if spec is not None:
                llm._executor.spec_decoder.draft_override = oracle
            prompts = [{"prompt_token_ids": p} for p in PROMPTS]
            outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            return outs, llm._executor.get_stats().num_preemptions

    reference, _ = run(None)
    outs, preemptions = run(MTP, _continuation(reference, lambda done: done % (K + 1)))
    assert outs == reference
    assert preemptions > 0
