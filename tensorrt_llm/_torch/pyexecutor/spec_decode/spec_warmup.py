"""Startup warm-up of speculative (MTP) steps, so that no served step compiles a kernel.

The shape warm-up (`warmup.py`) runs plain engine forwards only. A speculative step also
runs what only it uses: the MTP head's draft passes, the verify rows' checks, the recurrent
state's save and its rollback (the recorded rows' replay, or a restore and a replay forward
when the record would be too large), each with its own kernels and shapes. So once the
executor runs, and before its loop is armed in the step compile guard, `run_spec_warmup`
serves waves of short dummy requests through the real loop: one wave per batch class (1, 2,
3, then powers of two up to `max_batch_size`), each request long enough for a few verify
steps. The acceptance is forced per verify row in turn (none, all, one), so rejected,
accepted and partly accepted drafts, and therefore every rollback path, run in every wave.
Their counters are then reset: the warm-up's requests are not the user's.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from ....inputs.multimodal import MultimodalParams
from ....sampling_params import SamplingParams
from ..llm_request import LlmRequest
from .spec_decoder import AcceptOverride, SpecStats

if TYPE_CHECKING:
    from ..executor_types import LlmResponse
    from ..py_executor import PyExecutor

logger = logging.getLogger(__name__)

_REQUEST_ID_BASE = -3_000_000  # below the shape warm-up's and the capacity probe's ids
PROMPT_TOKENS = 8
# Drafts accepted per verify row, in turn (None: all of them).
ACCEPT_PATTERN: tuple[int | None, ...] = (0, None, 1)
VERIFY_STEPS = 3  # verify steps per request (at most; accepted drafts end it sooner)
WAVE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SpecWarmupReport:
    waves: int
    requests: int
    verify_rows: int
    draft_tokens: int
    accepted_tokens: int
    replays: int  # rows whose recurrent state was rolled back (hybrid models)
    seconds: float


def spec_warmup_batches(max_batch_size: int) -> list[int]:
    """1, 2, 3, then the powers of two below `max_batch_size`, and `max_batch_size`."""
    sizes = {1, 2, 3, max_batch_size}
    sizes.update(1 << i for i in range(2, max_batch_size.bit_length()))
    return sorted(s for s in sizes if 1 <= s <= max_batch_size)


def _accept_in_turn() -> AcceptOverride:
    calls = itertools.count()

    def accept(num_drafts: int) -> int:
        wanted = ACCEPT_PATTERN[next(calls) % len(ACCEPT_PATTERN)]
        return num_drafts if wanted is None else min(wanted, num_drafts)

    return accept


def _dummy_request(rid: int, input_processor: Any, use_mrope: bool, max_tokens: int) -> LlmRequest:
    ids = list(input_processor.get_dummy_prompt(PROMPT_TOKENS))[:PROMPT_TOKENS]
    params = None
    if use_mrope:
        ids, extra = input_processor({"prompt_token_ids": ids}, None)
        params = MultimodalParams(extra["multimodal_data"])
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return LlmRequest(rid, ids, sampling, multimodal_params=params)


def run_spec_warmup(
    executor: PyExecutor, input_processor: Any, max_batch_size: int
) -> SpecWarmupReport:
    """Serve the warm-up waves (module doc) through the started `executor`; raises
    RuntimeError when a warm-up request fails or a wave does not finish in time."""
    decoder = executor.spec_decoder
    if decoder is None:
        raise ValueError("run_spec_warmup needs an executor with a speculative decoder")
    start = time.perf_counter()
    k = decoder.max_draft_len
    max_tokens = VERIFY_STEPS * (k + 1) + 1
    use_mrope = executor.model_engine.use_mrope
    done: queue.Queue[LlmResponse] = queue.Queue()
    rid = _REQUEST_ID_BASE
    batches = spec_warmup_batches(max_batch_size)
    decoder.accept_override = _accept_in_turn()
    try:
        for size in tqdm(batches, desc="Warming up speculative steps", leave=False):
            for _ in range(size):
                rid -= 1
                req = _dummy_request(rid, input_processor, use_mrope, max_tokens)
                executor.enqueue_request(req, done.put)
            finished = 0
            while finished < size:
                try:
                    resp = done.get(timeout=WAVE_TIMEOUT_S)
                except queue.Empty:
                    raise RuntimeError(
                        f"speculative warm-up: a wave of {size} requests did not finish in "
                        f"{WAVE_TIMEOUT_S:.0f} s"
                    ) from None
                if resp.error is not None:
                    raise RuntimeError(f"speculative warm-up request failed: {resp.error}")
                finished += resp.finished
    finally:
        decoder.accept_override = None
    warmed, decoder.stats = decoder.stats, SpecStats()
    executor.reset_stats()
    report = SpecWarmupReport(
        waves=len(batches),
        requests=sum(batches),
        verify_rows=warmed.num_verify_rows,
        draft_tokens=warmed.num_draft_tokens,
        accepted_tokens=warmed.num_accepted_tokens,
        replays=warmed.num_replays,
        seconds=time.perf_counter() - start,
    )
    logger.info(
        "speculative warm-up: %d requests in %d waves (batches %s), %d verify rows, %d of %d "
        "drafts accepted, %d rollbacks, in %.1f s",
        report.requests,
        report.waves,
        batches,
        report.verify_rows,
        report.accepted_tokens,
        report.draft_tokens,
        report.replays,
        report.seconds,
    )
    return report
