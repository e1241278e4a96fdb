"""Tensor parallelism of the dense text stacks on 2 gloo ranks: every step's logits of a
chunked-prefill + decode schedule through the paged KV cache equal the TP=1 model's (float32),
for Qwen2, Qwen3 and the text decoders of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE
(experts split over the ranks); plus a kv head
replicated on both ranks, a vocabulary that does not split evenly and a tied LM head."""

from __future__ import annotations

from pathlib import Path

import torch
from tp_bodies import schedule_logits_all
from tp_harness import spawn_ranks

from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

WORLD = 2
# qwen3_vl_moe: its 4 experts split 2 a rank (expert parallelism, moe_ep_size = tp_size).
FAMILIES = ("qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def test_tp2_logits_equal_tp1(tmp_path: Path) -> None:
    ckpts = [write_tiny_checkpoint(f, tmp_path / f) for f in FAMILIES]
    # One kv head for two ranks, 515 vocab rows (258 a rank, the last padded), tied head.
    ckpts.append(
        write_tiny_checkpoint(
            "qwen3",
            tmp_path / "kv1",
            num_key_value_heads=1,
            vocab_size=515,
            tie_word_embeddings=True,
        )
    )
    names = [*FAMILIES, "qwen3 kv1/515/tied"]
    per_rank = spawn_ranks(schedule_logits_all, WORLD, [str(c) for c in ckpts])
    for rank, results in enumerate(per_rank):
        for name, result in zip(names, results, strict=True):
            # 4 query heads and 2 (or 1) kv heads: each rank holds 2 and 1.
            assert result["heads"] == (2, 1), f"{name} rank {rank}"
            pairs = zip(result["reference"], result["sharded"], strict=True)
            for step, (ref, got) in enumerate(pairs):
                msg = f"{name} rank {rank} step {step}"
                torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5, msg=msg)
                assert torch.equal(got.argmax(-1), ref.argmax(-1)), msg
        assert results[-1]["embed_rows"] == 258
