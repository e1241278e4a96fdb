"""Per-channel FP8 (`quantization="fp8"`, quantized after loading) at tensor_parallel_size=2
(2 gloo ranks, float32 on the CPU: the exact-dequantize torch path).

Weight scales are exact: a column-parallel shard's rows are whole rows of the TP=1 weight, a
row-parallel shard's rows are column slices whose amax is all-reduced (MAX) first, so every
rank's `weight_scale` and e4m3 values equal the TP=1 layer's for the same rows, bit for bit
(the dense MLP and attention, the Qwen3.5-MoE shared expert and Gated DeltaNet projections).

Activation per-token scales stay each rank's own (a row-parallel layer scales its input shard
by that shard's amax, finer than one GPU's): logits are within `ATOL` of TP=1 fp8's, not
equal, and no farther from the 16-bit model's than TP=1 fp8's are. NOTE: greedy tokens are not
compared: this random checkpoint's top-2 logit margins (median ~0.08) are below that
difference (median ~0.07), so a few argmaxes flip (3 of 24 rows); with all-reduced activation
scales the difference was 5e-7 (tried, not kept: a collective per row-parallel layer per
step). The engine end to end (the worker quantizes its shard too) is compared through prompt
logprobs, teacher-forced, so one flip cannot change the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tp_engine_bodies import PROMPTS
from tp_feature_bodies import fp8_per_channel_layers, fp8_schedule_logits
from tp_harness import spawn_ranks

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.tp_setup import check_model_shards
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

# Measured max |TP=2 - TP=1| of these fp8 logits: 0.096 (max |logit| 1.7); without the
# all-reduced weight amax it is larger.
ATOL = 0.15


def _rows_of(local: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """For each row of `local`, the index of the equal row of `full` (random rows: unique)."""
    matches = (local[:, None, :] == full[None, :, :]).all(-1)
    assert bool((matches.sum(-1) >= 1).all()), "a column shard row is no TP=1 row"
    return matches.int().argmax(-1)


def _check_layers(result: dict, rank: int) -> tuple[int, int]:
    """(column-parallel, row-parallel) layers checked; asserts each is TP=1's, exactly."""
    single, sharded = result["single"], result["sharded"]
    assert set(sharded) == set(single)
    columns = rows = 0
    for name, (w16, wq, scale) in sharded.items():
        full16, full_q, full_scale = single[name]
        k = w16.shape[1]
        if k < full16.shape[1]:  # row-parallel: this rank's column slice of every row
            cols = slice(rank * k, (rank + 1) * k)
            assert torch.equal(w16, full16[:, cols]), name
            assert torch.equal(scale, full_scale), f"{name} rank {rank} scales"
            assert torch.equal(wq, full_q[:, cols]), f"{name} rank {rank} e4m3"
            rows += 1
        else:  # column-parallel or replicated: whole rows
            index = _rows_of(w16, full16)
            assert torch.equal(scale, full_scale[index]), f"{name} rank {rank} scales"
            assert torch.equal(wq, full_q[index]), f"{name} rank {rank} e4m3"
            columns += 1
    return columns, rows


def test_tp2_fp8_weight_scales_are_the_tp1_scales(tmp_path: Path) -> None:
    dense = write_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    per_rank = spawn_ranks(fp8_per_channel_layers, 2, str(dense))
    for rank, result in enumerate(per_rank):
        assert _check_layers(result, rank) == (4, 4)  # qkv, gate_up / o, down x 2 layers


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_fp8_weight_scales_on_two_gpus(tmp_path: Path) -> None:
    dense = write_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    per_rank = spawn_ranks(fp8_per_channel_layers, 2, str(dense), True, device_type="cuda")
    for rank, result in enumerate(per_rank):
        assert _check_layers(result, rank) == (4, 4)


def test_tp2_fp8_moe_shared_expert_and_deltanet_scales(tmp_path: Path) -> None:
    # Qwen3.5-MoE: the shared expert's gate_up / down and DeltaNet's in / out projections
    # are column / row shards; the routed experts are no Linear (they stay 16-bit).
    moe = write_tiny_checkpoint("qwen3_5_moe", tmp_path / "qwen3_5_moe")
    per_rank = spawn_ranks(fp8_per_channel_layers, 2, str(moe))
    for rank, result in enumerate(per_rank):
        columns, rows = _check_layers(result, rank)
        assert columns > 0 and rows > 0
        assert any("shared_expert.down_proj" in n for n in result["sharded"])


def test_tp2_fp8_logits_close_to_tp1(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    for rank, result in enumerate(spawn_ranks(fp8_schedule_logits, 2, str(ckpt))):
        steps = zip(result["plain"], result["reference"], result["sharded"], strict=True)
        for step, (plain, ref, got) in enumerate(steps):
            msg = f"rank {rank} step {step}"
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0.0, msg=msg)
            # Each rank's finer activation scales lose nothing against one GPU's fp8.
            tp1_error = (ref - plain).abs().max()
            assert (got - plain).abs().max() <= 1.5 * tp1_error, msg


def test_llm_tp2_fp8_prompt_logprobs_close_to_tp1(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    kwargs = dict(device="cpu", max_batch_size=2, max_num_tokens=16, quantization="fp8")
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    with LLM(str(ckpt), **kwargs) as llm:
        reference = llm.generate(PROMPTS, params)
    with LLM(str(ckpt), tensor_parallel_size=2, **kwargs) as llm:
        outputs = llm.generate(PROMPTS, params)
    for mine, theirs in zip(outputs, reference, strict=True):
        assert mine.prompt_token_ids == theirs.prompt_token_ids
        for got, want in zip(mine.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True):
            ((token, lp),) = got.items()
            # log_softmax moves by at most twice the logits' difference.
            assert lp.logprob == pytest.approx(want[token].logprob, abs=2 * ATOL)


def test_per_channel_fp8_passes_the_tp_checks(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "bf16")
    config = LlmArgs(
        model=str(ckpt), device="cpu", tensor_parallel_size=2, quantization="fp8"
    ).to_engine_config()
    check_model_shards(config)  # refused before per-channel scales were all-reduced
