"""The KV cache of a tensor-parallel engine is sized by its poorest rank: ranks whose (faked)
free memory fits different block counts all allocate the minimum, agreed before any of them
allocates, and greedy tokens still equal a TP=1 engine's (2 gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tp_engine_bodies import MAX_TOKENS, PROMPTS, agreed_kv_blocks
from tp_harness import spawn_ranks

from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


@pytest.mark.parametrize("fits", [[48, 30], [30, 48]], ids=["worker-poorer", "rank0-poorer"])
def test_ranks_agree_on_the_least_kv_block_count(fits: list[int], tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    (reference, sharded, caches0, alone0), (caches1, alone1) = spawn_ranks(
        agreed_kv_blocks, 2, str(ckpt), fits, timeout_s=240
    )
    # The fake memory works: each rank alone would fit its own count.
    assert (alone0, alone1) == tuple(fits)
    # The probe's small cache, then the served one: the least count on both ranks.
    assert caches0[-1] == caches1[-1] == min(fits), (caches0, caches1)
    assert caches0 == caches1
    assert len(reference) == len(PROMPTS)
    assert all(len(tokens) == MAX_TOKENS for tokens in reference)
    assert sharded == reference
