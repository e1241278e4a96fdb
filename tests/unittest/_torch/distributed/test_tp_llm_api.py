"""`LLM(..., tensor_parallel_size=2)` on the CPU: the engine process is rank 0 and starts rank
1 (gloo); greedy outputs equal one rank's. A killed rank ends the engine with an error within
a bounded time, and no rank outlives a shutdown."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

# Two slots and 16-token steps: batching, chunked prefill and slot reuse in one generate.
KWARGS = dict(device="cpu", max_batch_size=2, max_num_tokens=16)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello there, how are you", "a much longer prompt " * 4, "short", "one more"]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tp") / "qwen3")


def test_llm_tp2_greedy_equals_tp1(ckpt: Path) -> None:
    with LLM(str(ckpt), **KWARGS) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm = LLM(str(ckpt), tensor_parallel_size=2, **KWARGS)
    try:
        ranks = _children(llm._executor.pid)
        assert len(ranks) == 1
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    assert outputs == reference
    assert not any(_alive(p) for p in ranks)


def test_killed_rank_ends_the_engine_with_an_error(ckpt: Path) -> None:
    llm = LLM(str(ckpt), tensor_parallel_size=2, **KWARGS)
    try:
        executor = llm._executor
        (rank1,) = _children(executor.pid)
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        handles = [llm.generate_async(f"long {i}", long) for i in range(2)]
        time.sleep(0.3)
        os.kill(rank1, signal.SIGKILL)
        start = time.monotonic()
        outs = [h.result(timeout=30) for h in handles]
        assert time.monotonic() - start < 15.0
        for out in outs:
            assert out.outputs[0].finish_reason == "error"
            # The step in flight fails on the lost rank, or the engine is gone already.
            error = out.error or ""
            assert "tensor-parallel" in error or "exit code 4" in error, error
        deadline = time.monotonic() + 10.0
        while executor.is_alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not executor.is_alive
        with pytest.raises(RuntimeError, match="engine process died"):
            llm.generate("after", GREEDY)
    finally:
        llm.shutdown()


def test_hybrid_tp2_greedy_equals_tp1(tmp_path: Path) -> None:
    """Qwen3.5 (Gated DeltaNet + gated attention): 16-token steps chunk the long prompt, two
    slots recycle their recurrent state."""
    hybrid = write_tiny_checkpoint("qwen3_5", tmp_path / "qwen3_5")
    with LLM(str(hybrid), **KWARGS) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with LLM(str(hybrid), tensor_parallel_size=2, **KWARGS) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert outputs == reference


def test_hybrid_mtp_tp2_greedy_equals_tp1(tmp_path: Path) -> None:
    """MTP speculative decoding through `LLM(..., tensor_parallel_size=2)`: the MTP head is
    sharded and rank 1 runs every forward of each speculative step; greedy output equals
    the non-speculative TP=1 run's."""
    hybrid = write_tiny_checkpoint("qwen3_5", tmp_path / "qwen3_5", mtp_num_hidden_layers=1)
    with LLM(str(hybrid), **KWARGS) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    mtp = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    with LLM(str(hybrid), tensor_parallel_size=2, speculative_config=mtp, **KWARGS) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        # Not built yet: such a request fails alone, before its step runs on any rank ...
        asking = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
        failed = llm.generate(PROMPTS[0], asking)
        # ... and the ranks stay in step.
        again = llm.generate(PROMPTS[1], GREEDY).outputs[0].token_ids
    assert outputs == reference
    assert "prompt_logprobs with speculative_config and tensor_parallel_size" in (
        failed.error or ""
    )
    assert again == reference[1]


def test_unsplittable_model_is_refused_before_ranks_start(ckpt: Path) -> None:
    # 4 attention heads over 3 ranks: rank 0's meta build refuses it, no rank is started.
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tensor"):
        LLM(str(ckpt), tensor_parallel_size=3, **KWARGS)


def test_hybrid_mtp_tp2_seeded_sampling_equals_tp1(tmp_path: Path) -> None:
    """Rejection sampling runs on rank 0 alone (the workers get its draft tokens and its
    accepted counts): seeded speculative sampling at TP=2 gives TP=1's tokens."""
    hybrid = write_tiny_checkpoint("qwen3_5", tmp_path / "qwen3_5", mtp_num_hidden_layers=1)
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    seeded = [
        SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=11 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    with LLM(str(hybrid), speculative_config=spec, **KWARGS) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded)]
    with LLM(str(hybrid), tensor_parallel_size=2, speculative_config=spec, **KWARGS) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded)]
    assert outputs == reference
    assert len({tuple(o) for o in outputs}) > 1  # sampled, not one greedy run repeated
