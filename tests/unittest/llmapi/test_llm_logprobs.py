"""`SamplingParams.logprobs` end to end through `LLM` on a tiny random qwen2 (CPU, fp32).

Every generated token's logprob is HF's log_softmax at that position (teacher-forced over the
same tokens), for greedy and seeded sampled requests, with top-k order and ranks; a request
without logprobs in the same batch gets none; the overlap scheduler on and off, process mode,
and streamed diffs that add up to the final list.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import Logprob
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

KWARGS: dict[str, Any] = dict(
    device="cpu", max_batch_size=4, max_num_tokens=128, max_seq_len=128, tokens_per_block=16
)
PROMPTS = ["the quick brown fox", "a b c", "hello there, general"]
ATOL = 2e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("logprobs"))


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),  # no logprobs
        SamplingParams(
            max_tokens=6, temperature=1.0, seed=11, logprobs=0, ignore_eos=True, top_k=20
        ),
    ]


def _hf_logprobs(hf: Any, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """[len(out_ids), vocab] HF log_softmax of the position before each output token."""
    ids = torch.tensor([prompt_ids + out_ids[:-1]])
    with torch.no_grad():
        logits = hf(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1 :], dim=-1)


def _check_against_hf(hf: Any, outputs: list[Any], params: list[SamplingParams]) -> None:
    for result, sp in zip(outputs, params, strict=True):
        out = result.outputs[0]
        if sp.logprobs is None:
            assert out.logprobs == [] and out.cumulative_logprob is None
            continue
        assert len(out.logprobs) == len(out.token_ids) == sp.max_tokens
        want = _hf_logprobs(hf, list(result.prompt_token_ids), list(out.token_ids))
        for pos, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = want[pos]
            assert next(iter(entry)) == tok  # the sampled token comes first
            assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=ATOL)
            # Ranks count the strictly more likely tokens; values within ATOL may swap.
            surely_above = int((row > row[tok] + ATOL).sum())
            maybe_above = int((row > row[tok] - ATOL).sum()) - 1
            rank = entry[tok].rank
            assert rank is not None and surely_above + 1 <= rank <= maybe_above + 1
            top = row.topk(sp.logprobs)
            alternatives = {t: v for t, v in entry.items() if v.rank <= sp.logprobs}
            if sp.logprobs:
                ranked = sorted(alternatives, key=lambda t: alternatives[t].rank)
                assert ranked == top.indices.tolist()
                got = [alternatives[t].logprob for t in ranked]
                assert got == pytest.approx(top.values.tolist(), abs=ATOL)
                assert [alternatives[t].rank for t in ranked] == list(range(1, sp.logprobs + 1))
            assert len(entry) in (sp.logprobs, sp.logprobs + 1)
        total = sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True))
        assert out.cumulative_logprob == pytest.approx(total, abs=1e-6)
    greedy = outputs[0].outputs[0]
    assert all(e[t].rank == 1 for t, e in zip(greedy.token_ids, greedy.logprobs, strict=True))


@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_match_hf_in_a_mixed_batch(ckpt: Path, hf: Any, overlap: bool) -> None:
    params = _params()
    with LLM(
        str(ckpt), executor_mode="inproc", disable_overlap_scheduler=not overlap, **KWARGS
    ) as llm:
        outputs = llm.generate(PROMPTS, params)
        # A stop token mid-way: the overlap executor's extra in-flight token is dropped, and
        # its logprobs with it.
        stop_at = outputs[0].outputs[0].token_ids[2]
        stopped = llm.generate(
            PROMPTS[0],
            SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, stop_token_ids=[stop_at]),
        ).outputs[0]
    _check_against_hf(hf, outputs, params)
    first = stopped.token_ids.index(stop_at) + 1
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == first
    batched = outputs[0].outputs[0].logprobs[:first]
    assert [list(e) for e in stopped.logprobs] == [list(e) for e in batched]
    sampled = outputs[2].outputs[0]
    assert any(e[t].rank > 1 for t, e in zip(sampled.token_ids, sampled.logprobs, strict=True))


def test_logprobs_cross_the_process_boundary_and_stream(ckpt: Path, hf: Any) -> None:
    params = _params()
    with LLM(str(ckpt), executor_mode="process", **KWARGS) as llm:
        outputs = llm.generate(PROMPTS, params)
        _check_against_hf(hf, outputs, params)

        async def stream() -> tuple[list[Any], list[int], Any]:
            diffs: list[Any] = []
            counts: list[int] = []
            handle = llm.generate_async(PROMPTS[0], params[0], streaming=True)
            async for snap in handle:
                out = snap.outputs[0]
                diffs.extend(out.logprobs_diff)
                counts.append(len(out.logprobs_diff))
                assert len(out.logprobs) == len(out.token_ids)
            return diffs, counts, await handle

        diffs, counts, final = asyncio.run(stream())
    assert diffs == final.outputs[0].logprobs
    # Alone instead of in a batch of three: the same tokens, the same values up to rounding.
    assert final.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    for mine, batched in zip(diffs, outputs[0].outputs[0].logprobs, strict=True):
        assert list(mine) == list(batched)
        assert [v.logprob for v in mine.values()] == pytest.approx(
            [v.logprob for v in batched.values()], abs=1e-5
        )
    assert len(counts) > 1 and all(c >= 1 for c in counts)
    assert isinstance(diffs[0][final.outputs[0].token_ids[0]], Logprob)
