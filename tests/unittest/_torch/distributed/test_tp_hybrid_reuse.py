"""Prefix caching of a hybrid stack (tiny Qwen3.5) at TP=2 on gloo: rank 0's snapshot pool
picks every entry, the step carries its copies and the worker replays them on its own state
shard. A repeated prompt and the next turn of a chat hit the cache and give TP=1's greedy
tokens (reuse off); a worker that missed or misplaced a restore would read a wrong DeltaNet
state and change them. Both ranks made the same copies, restores among them, into pools of
the least entry count any rank fits."""

from __future__ import annotations

from pathlib import Path

from tp_harness import spawn_ranks
from tp_reuse_bodies import MAX_TOKENS, TPB, WORKER_ENTRIES, chat_tp1_and_tp

from tensorrt_llm._torch.pyexecutor.state_snapshot_pool import SNAPSHOT_RESTORE, SNAPSHOT_SAVE
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

WORLD = 2


def test_tp2_hybrid_prefix_cache_hits_and_equals_tp1(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3_5", tmp_path / "qwen3_5")
    (reference, sharded, sent, lead_pool), (worker_steps, applied, worker_pool) = spawn_ranks(
        chat_tp1_and_tp, WORLD, str(ckpt), timeout_s=300
    )
    assert [tokens for tokens, _ in sharded] == [tokens for tokens, _ in reference]
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in reference)
    assert all(cached == 0 for _, cached in reference)  # reuse off
    cached = [c for _, c in sharded]
    assert cached[0] == 0
    assert cached[1] > 0 and cached[1] % TPB == 0  # the repeat: its prompt-end snapshot
    assert cached[2] > cached[1]  # the next turn: into the previous answer
    assert worker_steps > 0
    # The worker replayed exactly rank 0's copies, in order, by the same entry indices.
    assert applied == sent
    kinds = {kind for kind, _, _ in sent}
    assert kinds == {SNAPSHOT_SAVE, SNAPSHOT_RESTORE}
    # The worker fits fewer snapshots: both pools hold the least count (entry indices agree).
    assert lead_pool == worker_pool == {WORKER_ENTRIES}
    assert max(entry for _, entry, _ in sent) < WORKER_ENTRIES
