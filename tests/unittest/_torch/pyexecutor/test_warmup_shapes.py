"""The warm-up's steps cover the size classes of every step the engine can run."""

from __future__ import annotations

import random

import pytest

from tensorrt_llm._torch.modules.gated_delta_net_rows import RECURRENT_ROWS_MAX_TOKENS
from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import DEFAULT_BATCH_SIZES, pick_bucket
from tensorrt_llm._torch.pyexecutor.warmup_shapes import (
    StepLimits,
    StepShape,
    covered_features,
    features,
    size_class,
    warmup_steps,
)


def _every_possible_step(limits: StepLimits) -> set[StepShape]:
    """Brute force, from the scheduler's bounds alone: every (context tokens, chunks,
    generation rows) with tokens <= max_num_tokens and requests <= max_batch_size."""
    out: set[StepShape] = set()
    for ctx in range(limits.max_num_tokens + 1):
        for gen in range(limits.max_batch_size + 1):
            if ctx + gen == 0 or ctx + gen > limits.max_num_tokens:
                continue
            most = min(ctx, limits.max_batch_size - gen)
            fewest = limits.min_contexts(ctx)
            for chunks in {0} if ctx == 0 else {fewest, most} if most >= fewest else set():
                out.add(StepShape(ctx, chunks, gen))
                if chunks:  # a chunk continuing its request
                    out.add(StepShape(ctx, chunks, gen, carried=True))
                if chunks and ctx <= chunks * RECURRENT_ROWS_MAX_TOKENS:  # all, all short
                    out.add(StepShape(ctx, chunks, gen, carried=True, rows=True))
    return out


def _limits_cases() -> list[StepLimits]:
    rng = random.Random(7)
    cases = [
        StepLimits(96, 24, (1, 2, 4, 8, 16), True, 64),
        StepLimits(96, 24, (1, 2, 4, 8, 16), True, 64, recurrent_rows=True),
        StepLimits(96, 24, (), True, 0),
        StepLimits(40, 40, (3, 9), False, 17),
        StepLimits(1, 1),
    ]
    for _ in range(40):
        tokens, batch = rng.randint(1, 120), rng.randint(1, 40)
        graphs = tuple(sorted(rng.sample(range(1, batch + 1), rng.randint(0, min(4, batch)))))
        piecewise = rng.choice([0, rng.randint(1, tokens)])
        chunk = rng.choice([0, rng.randint(1, tokens)])  # a short max_seq_len
        hybrid = rng.random() < 0.5
        cases.append(
            StepLimits(tokens, batch, graphs, rng.random() < 0.5, piecewise, chunk, hybrid)
        )
    return cases


@pytest.mark.parametrize("limits", _limits_cases(), ids=str)
def test_warmup_covers_every_possible_step(limits: StepLimits) -> None:
    steps = warmup_steps(limits)
    assert all(limits.is_possible(s) for s in steps)
    needed: set[tuple] = set()
    for shape in _every_possible_step(limits):
        needed |= features(limits, shape)
    missing = needed - covered_features(limits, steps)
    assert not missing, f"warm-up misses {sorted(missing)[:5]}"


def test_graph_path_matches_the_decode_runner() -> None:
    """StepLimits' idea of a graph replay is the CUDAGraphRunner's bucket choice."""
    for padding in (True, False):
        limits = StepLimits(4096, 512, DEFAULT_BATCH_SIZES[:-3], padding)
        for g in range(1, 513):
            replay = pick_bucket(list(DEFAULT_BATCH_SIZES[:-3]), g, padding) is not None
            assert limits.replays_decode_graph(g) == replay


def test_size_class_and_real_size_counts() -> None:
    assert [size_class(n) for n in (1, 2, 3, 16, 17, 32, 33)] == [
        (1, False), (2, False), (4, False), (16, True), (32, False), (32, True), (64, False),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="n >= 1"):
        size_class(0)
    # The real-size defaults: a bounded number of steps, each possible.
    limits = StepLimits(8192, 512, DEFAULT_BATCH_SIZES, True, 2048)
    steps = warmup_steps(limits)
    assert 20 < len(steps) < 200
    assert max(s.num_tokens for s in steps) == 8192
    # Everything the decode graphs cover is left to them.
    assert not [s for s in steps if s.num_contexts == 0]


@pytest.mark.parametrize("chunked", [True, False])
def test_warmup_covers_what_the_real_scheduler_produces(chunked: bool) -> None:
    """Random arrivals through SimpleScheduler: every step it makes is possible by StepLimits
    and its features are among the warm-up's."""
    import torch

    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm._torch.pyexecutor.request_lifecycle import apply_step_results, sample_rows
    from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager
    from tensorrt_llm._torch.pyexecutor.scheduler import SimpleScheduler
    from tensorrt_llm.sampling_params import SamplingParams

    batch, tokens = 6, 32
    limits = StepLimits(tokens, batch, (1, 2, 4), True, 16, recurrent_rows=True)
    covered = covered_features(limits, warmup_steps(limits))
    kv = KVCacheManager(1, 1, 4, 4, 256, 32, torch.float32, "cpu")
    sched = SimpleScheduler(batch, tokens, chunked, kv, SeqSlotManager(batch))
    rng = random.Random(3 + chunked)
    active: list[LlmRequest] = []
    seen, carried_seen, rows_seen = 0, False, False
    for step in range(300):
        for _ in range(rng.choice([0, 0, 1, 3])):
            prompt = rng.randint(1, 60 if chunked else tokens)
            params = SamplingParams(max_tokens=rng.randint(1, 12))
            active.append(LlmRequest(1000 * step + len(active), [1] * prompt, params))
        out = sched.schedule(active)
        ctx = sum(r.context_chunk_size for r in out.context_requests)
        starts = [r.context_current_position for r in out.context_requests]
        carried = any(p > 0 for p in starts)
        rows = bool(starts) and all(
            p > 0 and r.context_chunk_size <= RECURRENT_ROWS_MAX_TOKENS
            for p, r in zip(starts, out.context_requests, strict=True)
        )
        rows_seen = rows_seen or rows
        shape = StepShape(
            ctx, len(out.context_requests), len(out.generation_requests), carried, rows
        )
        if shape.num_tokens:
            seen += 1
            carried_seen = carried_seen or carried
            assert limits.is_possible(shape), shape
            assert features(limits, shape) <= covered, shape
        everyone = out.all_requests
        produced = [everyone[i] for i in sample_rows(out)]
        apply_step_results(out, produced, [2] * len(produced))
        for req in produced:
            if req.is_finished:
                sched.release_resources(req)
        active = [r for r in active if not r.is_finished]
    assert seen > 200 and (carried_seen or not chunked) and (rows_seen or not chunked)
