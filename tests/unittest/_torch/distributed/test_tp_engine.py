"""The tensor-parallel engine on 2 gloo ranks: rank 0's executor schedules, samples and
broadcasts every step (the capacity probe's too) to rank 1's worker loop; its greedy tokens
equal a TP=1 engine's through batching, chunked prefill and seq-slot reuse (dense, VL with
images, and Qwen3-VL-MoE with its experts split over the ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tp_engine_bodies import MAX_TOKENS, PROMPTS, greedy_tp1_and_tp
from tp_harness import spawn_ranks

from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


@pytest.mark.parametrize(
    ("family", "images"), [("qwen3", False), ("qwen2_5_vl", True), ("qwen3_vl_moe", True)]
)
def test_tp2_engine_greedy_equals_tp1(family: str, images: bool, tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(family, tmp_path / family)
    (reference, sharded), worker_steps = spawn_ranks(greedy_tp1_and_tp, 2, str(ckpt), images)
    assert len(reference) == len(PROMPTS) + (2 if images else 0)
    assert all(len(tokens) == MAX_TOKENS for tokens in reference)
    assert sharded == reference
    # The worker ran at least the decode steps of every request (two slots, four+ requests).
    assert worker_steps >= MAX_TOKENS * len(reference) // 2
