"""Tensor parallelism of the Qwen3.5 hybrid stack (Gated DeltaNet + gated attention) on 2
gloo ranks: every step's logits of a chunked-prefill + decode schedule equal the TP=1
model's (float32). Each rank holds half the DeltaNet key and value heads (their q, k, v
rows, conv channels and states) and half the attention heads with their output gates."""

from __future__ import annotations

from pathlib import Path

import torch
from tp_bodies import schedule_logits_all
from tp_harness import spawn_ranks

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
