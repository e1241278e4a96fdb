"""SimpleScheduler with `HybridKvCacheReuse`, without a model: a stand-in recurrent layer
whose per-slot state is an order-sensitive sum over the tokens a sequence has run (it reads
the slot's state when the chunk starts past position 0, as the DeltaNet layers do). After
every step each scheduled request's state must equal that sum over its whole sequence so far,
whatever hits, restores, chunk splits, evictions and preemptions happened on the way. A
request's `inner_snapshot` (a point inside its chunk) gets the state at that point written
into its scratch slot, as the DeltaNet layers do."""

from __future__ import annotations

import torch

from tensorrt_llm._torch.pyexecutor.hybrid_kv_cache_reuse import (
    INNER_SNAPSHOT_ENV,
    HybridKvCacheReuse,
)
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.request_lifecycle import apply_step_results, sample_rows
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests, SimpleScheduler
from tensorrt_llm._torch.pyexecutor.state_snapshot_pool import RecurrentSnapshotPool
from tensorrt_llm.sampling_params import SamplingParams

TPB = 4
SLOTS = 4
PROMPT = list(range(1, 19))  # 18 tokens


def _contribution(tokens: list[int], start: int) -> float:
    return float(sum((start + i + 1) * (t + 1) for i, t in enumerate(tokens)))


class _Engine:
    """The scheduler, its reuse over a snapshot pool of `entries`, and the stand-in state."""

    def __init__(
        self, num_blocks: int, entries: int = 64, max_num_tokens: int = 64, scratch: int = 2
    ) -> None:
        kv = KVCacheManager(1, 1, 4, TPB, num_blocks, 64, torch.float32, "cpu", True)
        # [slot rows, 2]: the scheduler's, then the scratch slots, then the dummy.
        self.state = torch.zeros(SLOTS + scratch + 1, 2, dtype=torch.float64)
        pool = RecurrentSnapshotPool({"recurrent.s": self.state}, entries * 16)
        self.reuse = HybridKvCacheReuse(kv, pool, scratch_slots=range(SLOTS, SLOTS + scratch))
        self.sched = SimpleScheduler(
            SLOTS, max_num_tokens, True, kv, SeqSlotManager(SLOTS), 0, reuse=self.reuse
        )
        self.chunks: list[tuple[int, int, int]] = []  # (request id, begin, end) of each chunk
        self.inner: list[tuple[int, int]] = []  # (request id, point) snapshotted inside a chunk

    def _forward(self, out: ScheduledRequests) -> None:
        for req in out.context_requests:
            begin = req.context_current_position
            end = begin + req.context_chunk_size
            self.chunks.append((req.request_id, begin, end))
            tokens = [int(t) for t in req.context_token_array[begin:end]]
            row = self.state[req.seq_slot]
            if begin == 0:
                row.zero_()  # a fresh sequence, even in a recycled slot
            if req.inner_snapshot is not None:
                point, scratch = req.inner_snapshot
                assert begin < point < end and SLOTS <= scratch < self.state.shape[0] - 1
                self.inner.append((req.request_id, point))
                self.state[scratch][0] = row[0] + _contribution(tokens[: point - begin], begin)
                self.state[scratch][1] = point
            row[0] += _contribution(tokens, begin)
            row[1] = end  # tokens the state covers
        for req in out.generation_requests:
            pos = req.num_tokens - 1
            row = self.state[req.seq_slot]
            assert row[1] == pos, "a decode step must continue where the state ends"
            row[0] += _contribution([req.all_token_ids[pos]], pos)
            row[1] = pos + 1

    def step(self, reqs: list[LlmRequest], token: int) -> ScheduledRequests:
        out = self.sched.schedule([r for r in reqs if not r.is_finished])
        self._forward(out)
        self.reuse.register_step(out)
        for req in out.all_requests:  # the invariant this test is about
            covered = int(self.state[req.seq_slot][1])
            want = _contribution(req.all_token_ids[:covered], 0)
            assert self.state[req.seq_slot][0] == want, (req.request_id, covered)
        everyone = out.all_requests
        produced = [everyone[i] for i in sample_rows(out)]
        apply_step_results(out, produced, [token + r.request_id for r in produced])
        for req in produced + out.failed:
            if req.is_finished:
                self.reuse.register_finished(req)
                self.sched.release_resources(req)
        self.reuse.snapshots.check_invariants()
        self.sched.kv_cache_manager.pool.check_invariants()
        return out

    def run(self, reqs: list[LlmRequest], token: int = 7) -> list[ScheduledRequests]:
        steps = []
        for _ in range(300):
            if all(r.is_finished for r in reqs):
                return steps
            steps.append(self.step(reqs, token))
        raise AssertionError("requests did not finish")


def _req(rid: int, prompt: list[int], max_tokens: int = 6) -> LlmRequest:
    return LlmRequest(rid, prompt, SamplingParams(max_tokens=max_tokens))


def test_prefill_snapshots_inside_its_one_chunk_and_a_repeat_restores_it() -> None:
    eng = _Engine(64)
    first = _req(0, PROMPT)
    eng.run([first])
    # 18 tokens in one chunk; the state at 16 (the last boundary before token 17) is taken
    # inside it, through a scratch slot that is free again after the step.
    assert eng.chunks == [(0, 0, 18)] and eng.inner == [(0, 16)]
    assert eng.reuse.num_free_scratch_slots == 2
    again = _req(1, PROMPT)
    eng.run([again])
    assert again.num_cached_tokens == 16 and eng.chunks[1:] == [(1, 16, 18)]
    assert eng.reuse.snapshots.stats.restored == 1


def test_chunk_holding_two_points_ends_at_the_second(monkeypatch) -> None:
    eng = _Engine(64)
    first = _req(0, PROMPT)
    monkeypatch.setattr(eng.reuse, "snapshot_points", lambda req: [8, 12, 16])
    eng.run([first])
    # One point per chunk inside it, the next one ends the chunk (snapshotted from the slot).
    assert eng.chunks == [(0, 0, 12), (0, 12, 18)] and eng.inner == [(0, 8), (0, 16)]
    assert all(eng.reuse.snapshots.has(first.block_keys[p // TPB - 1]) for p in (8, 12, 16))


def test_a_full_batch_still_snapshots_inside_its_chunks() -> None:
    eng = _Engine(64, max_num_tokens=128, scratch=SLOTS)
    reqs = [_req(i, [10 * i + t for t in PROMPT]) for i in range(SLOTS)]
    eng.run(reqs)
    # The 4 admissions take every scheduler slot; the scratch slots are rows of their own,
    # so each prompt still prefills in one chunk with its point taken inside it.
    assert sorted(eng.chunks) == [(i, 0, 18) for i in range(SLOTS)]
    assert sorted(eng.inner) == [(i, 16) for i in range(SLOTS)]
    assert eng.reuse.num_free_scratch_slots == SLOTS


def test_no_free_scratch_slot_ends_the_chunk_at_the_point() -> None:
    eng = _Engine(64, max_num_tokens=128, scratch=1)
    reqs = [_req(i, [10 * i + t for t in PROMPT]) for i in range(2)]
    eng.run(reqs)
    # One scratch slot for two chunks with a point: the second ends at its point (old way).
    assert sorted(eng.chunks) == [(0, 0, 18), (1, 0, 16), (1, 16, 18)]
    assert eng.inner == [(0, 16)] and eng.reuse.num_free_scratch_slots == 1


def test_inner_snapshot_switch_off_ends_chunks_at_points(monkeypatch) -> None:
    monkeypatch.setenv(INNER_SNAPSHOT_ENV, "0")
    eng = _Engine(64)
    eng.run([_req(0, PROMPT)])
    assert eng.chunks == [(0, 0, 16), (0, 16, 18)] and eng.inner == []


def test_no_snapshot_no_hit_even_with_the_kv_cached() -> None:
    eng = _Engine(64)
    eng.run([_req(0, PROMPT)])
    eng.reuse.snapshots.clear()
    again = _req(1, PROMPT)
    eng.run([again])
    assert again.num_cached_tokens == 0
    third = _req(2, PROMPT)  # `again` snapshotted where its cached KV ended
    eng.run([third])
    assert third.num_cached_tokens == 16


def test_next_turn_restores_the_committed_decode_snapshot() -> None:
    eng = _Engine(64)
    first = _req(0, PROMPT, max_tokens=9)  # 27 tokens: crossings at 20 and 24
    eng.run([first])
    follow = _req(1, first.all_token_ids + [90, 91, 92])
    eng.run([follow])
    assert follow.num_cached_tokens == 24
    assert eng.reuse.snapshots.num_pending == 0


def test_small_snapshot_pool_and_preemption_keep_the_state_exact() -> None:
    # 11 blocks for three requests of 18 + 12 tokens: preemptions; 3 snapshot entries: LRU.
    eng = _Engine(11, entries=3)
    prompts = [PROMPT, [50 + t for t in PROMPT], PROMPT[:10] + [70 + t for t in PROMPT[10:]]]
    reqs = [_req(i, p, max_tokens=12) for i, p in enumerate(prompts)]
    steps = eng.run(reqs)
    assert sum(len(s.preempted) for s in steps) > 0
    again = [_req(10 + i, p, max_tokens=12) for i, p in enumerate(prompts)]
    eng.run(again)
    assert eng.reuse.snapshots.stats.evicted > 0 or eng.reuse.snapshots.stats.dropped > 0
    assert all(len(r.output_token_ids) == 12 for r in reqs + again)
    assert eng.reuse.snapshots.num_pending == 0
    assert eng.sched.kv_cache_manager.num_used_blocks == 0


def test_a_short_divergence_adds_no_snapshot_point() -> None:
    """A next turn whose cached KV runs one block past the last snapshot (a chat's usual case)
    does not split its prefill there: the gain is below MIN_DIVERGENCE_GAIN_BLOCKS."""
    eng = _Engine(64)
    first = _req(0, PROMPT, max_tokens=6)  # 24 tokens: snapshots at 16 and (decode) at 20
    eng.run([first])
    eng.reuse.snapshots.drop(first.block_keys[4])  # the one at 20
    follow = _req(1, first.all_token_ids + [90, 91, 92, 93, 94, 95])  # 30 tokens
    eng.run([follow])
    assert follow.num_cached_tokens == 16
    # From the hit to the end in one chunk, snapshotted inside at its last boundary only.
    assert [c for c in eng.chunks if c[0] == 1] == [(1, 16, 30)]
    assert [p for rid, p in eng.inner if rid == 1] == [28]
