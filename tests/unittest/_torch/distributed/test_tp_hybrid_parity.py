"""Tensor parallelism of the Qwen3.5 hybrid stacks (Gated DeltaNet + gated attention, dense
and MoE) on 2 gloo ranks: every step's logits of a chunked-prefill + decode schedule equal
the TP=1 model's (float32, and block-FP8 as the engine builds it), and so do greedy tokens
through the engine (with images). Each rank holds half the DeltaNet key and value heads
(their q, k, v rows, conv channels and states), half the attention heads with their output
gates and half the experts (the shared expert tensor-parallel); settings not built yet are
refused before ranks start, and the slot counts presized from each rank's memory agree
(MIN)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tp_bodies import schedule_logits_all, schedule_logits_as_built
from tp_engine_bodies import MAX_TOKENS, greedy_tp1_and_tp
from tp_harness import spawn_ranks

from tensorrt_llm._torch.pyexecutor.tp_setup import check_model_shards
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

WORLD = 2
FAMILIES = ("qwen3_5", "qwen3_5_moe")


def test_tp2_hybrid_logits_equal_tp1(tmp_path: Path) -> None:
    # The tiny qwen3_5: 2 key / 4 value DeltaNet heads, 4 query / 2 kv attention heads.
    ckpts = [write_tiny_checkpoint(f, tmp_path / f) for f in FAMILIES]
    per_rank = spawn_ranks(schedule_logits_all, WORLD, [str(c) for c in ckpts])
    for rank, results in enumerate(per_rank):
        for family, result in zip(FAMILIES, results, strict=True):
            assert result["heads"] == (2, 1), f"{family} rank {rank}"
            assert result["gdn_heads"] == [(1, 2)] * 3, f"{family} rank {rank}"
            pairs = zip(result["reference"], result["sharded"], strict=True)
            for step, (ref, got) in enumerate(pairs):
                msg = f"{family} rank {rank} step {step}"
                torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5, msg=msg)
                assert torch.equal(got.argmax(-1), ref.argmax(-1)), msg


def test_hybrid_settings_not_built_are_refused(tmp_path: Path) -> None:
    """Before any rank starts: block-FP8 shards that split a block (prefix caching runs:
    test_tp_hybrid_reuse.py; MTP speculation builds its head's shards: test_tp_mtp.py)."""
    ckpt = write_tiny_checkpoint("qwen3_5", tmp_path / "mtp", mtp_num_hidden_layers=1)
    tp2 = dict(model=str(ckpt), device="cpu", tensor_parallel_size=2, max_batch_size=2)
    mtp = {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
    check_model_shards(LlmArgs(**tp2, speculative_config=mtp).to_engine_config())
    # Block-FP8: 16-dim DeltaNet heads give a rank 16-row q, k ranges, not whole 128-blocks.
    fp8 = write_tiny_checkpoint("qwen3_5", tmp_path / "fp8", quantization="fp8_block")
    config = LlmArgs(**{**tp2, "model": str(fp8)}).to_engine_config()
    with pytest.raises(ValueError, match=r"in_proj_qkvz: .*rows \[0, 16\)"):
        check_model_shards(config)
    check_model_shards(LlmArgs(**tp2).to_engine_config())  # the rest builds


# 128-dim DeltaNet and attention heads, 128 channels a rank: every shard is whole 128-blocks
# (a rank's q, k and v ranges each start on a block boundary).
# Logits are ~2 in magnitude; see test_tp2_fp8_block_hybrid_logits_equal_tp1.
FP8_TP_ATOL = 0.15
FP8_TEXT = dict(
    hidden_size=128,
    head_dim=128,
    intermediate_size=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    # rotary 128 * 0.25 = 32 -> half 16 = 6 + 5 + 5
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.25,
    },
)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_fp8_block_hybrid_logits_equal_tp1(family: str, tmp_path: Path) -> None:
    """Block-FP8 (the -FP8 releases' layout) as the engine builds it: each rank's e4m3
    in_proj_qkv rows and their scales come as the same three ranges; every step's logits
    equal TP=1's within FP8_TP_ATOL. Not greedy tokens through the engine: the all-reduce
    sums in another order, and where that moves an activation across an e4m3 rounding step
    the flip grows through the later quantizations (measured: one such flip in the MoE of
    layer 0, 1e-4, reached 7e-2 at the logits), which flips near-tied argmaxes of random
    weights on some CPUs. A wrong shard or scale range is off by O(1)."""
    ckpt = write_tiny_checkpoint(
        family,
        tmp_path / family,
        quantization="fp8_block",
        text_config=FP8_TEXT,
        vision_config={"out_hidden_size": FP8_TEXT["hidden_size"]},
    )
    per_rank = spawn_ranks(schedule_logits_as_built, WORLD, str(ckpt))
    for rank, result in enumerate(per_rank):
        pairs = zip(result["reference"], result["sharded"], strict=True)
        for step, (ref, got) in enumerate(pairs):
            msg = f"{family} rank {rank} step {step}"
            torch.testing.assert_close(got, ref, atol=FP8_TP_ATOL, rtol=0.0, msg=msg)


def test_tp2_hybrid_vl_with_images_greedy_equals_tp1(tmp_path: Path) -> None:
    """Qwen3.5-VL through the engine with images (the tower data-parallel over the ranks,
    mRoPE positions): greedy tokens equal TP=1's."""
    ckpt = write_tiny_checkpoint("qwen3_5", tmp_path / "qwen3_5")
    (reference, sharded), worker_steps = spawn_ranks(greedy_tp1_and_tp, WORLD, str(ckpt), True)
    assert all(len(tokens) == MAX_TOKENS for tokens in reference)
    assert sharded == reference
    assert worker_steps > 0


def _agreed_slots(mapping: Mapping, fits: list[int]) -> tuple[int, str]:
    from tensorrt_llm._torch.pyexecutor.capacity import BatchSizing
    from tensorrt_llm._torch.pyexecutor.model_build import agree_hybrid_slots

    own = BatchSizing(fits[mapping.rank], "cap")
    agreed = agree_hybrid_slots(own, mapping, torch.device("cpu"))
    return agreed.max_batch_size, agreed.bound


def test_presized_hybrid_slots_are_the_least_any_rank_fits() -> None:
    """CUDA presizing without max_batch_size: each rank sizes its recurrent state from its
    own memory, and every rank builds the least count (rank 1 fits fewer here)."""
    assert spawn_ranks(_agreed_slots, WORLD, [6, 3]) == [(3, "recurrent state"), (3, "cap")]
