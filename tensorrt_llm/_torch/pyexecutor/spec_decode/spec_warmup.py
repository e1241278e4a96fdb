"""Startup warm-up of speculative (MTP) steps, so that no served step compiles a kernel.

The shape warm-up (`warmup.py`) runs plain engine forwards only. A speculative step also
runs what only it uses: the MTP head's draft passes, the verify rows' checks, the recurrent
state's save and its rollback (the recorded rows' replay, or a restore and a replay forward
when the record would be too large), each with its own kernels and shapes. So once the
executor runs, and before its loop is armed in the step compile guard, `run_spec_warmup`
serves waves of dummy requests through the real loop: one wave per batch class (1, 2, 3,
then powers of two up to `max_batch_size`) of short prompts, each request long enough for a
few verify steps; then one request per prompt length class (a power of two and the length
one below it, up to `max_num_tokens`), since the head's first pass covers each prefill
chunk's tokens. The acceptance is forced per verify row in turn (none, all, one), so rejected,
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

from ....sampling_params import SamplingParams
from ..llm_request import LlmRequest
from ..warmup import dummy_prompt
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


def spec_warmup_prompt_lengths(max_num_tokens: int, max_prompt_len: int) -> list[int]:
    """A power of two and the length one below it (the other side of Triton's "multiple of
    16" specialization), up to the longest chunk a step can hold."""
    cap = min(max_num_tokens, max_prompt_len)
    lengths = {1}
    p = 2
    while p <= cap:
        lengths.update((p - 1, p))
        p *= 2
    if cap > 1:
        lengths.update((cap - 1, cap))
    return sorted(n for n in lengths if n != PROMPT_TOKENS)


def _accept_in_turn() -> AcceptOverride:
    calls = itertools.count()

    def accept(num_drafts: int) -> int:
        wanted = ACCEPT_PATTERN[next(calls) % len(ACCEPT_PATTERN)]
        return num_drafts if wanted is None else min(wanted, num_drafts)

    return accept


def _dummy_request(
    rid: int, input_processor: Any, use_mrope: bool, max_tokens: int, prompt_len: int
) -> LlmRequest:
    ids, params = dummy_prompt(input_processor, prompt_len, use_mrope)
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
    # Leave a prompt of PROMPT_TOKENS room even on a short max_seq_len (2: the overlap's
    # spare token and one more).
    room = executor.max_seq_len - 2
    max_tokens = max(1, min(VERIFY_STEPS * (k + 1) + 1, room - PROMPT_TOKENS))
    max_prompt = room - max_tokens
    if max_prompt < 1:
        logger.warning("speculative warm-up skipped: max_seq_len %d is too short", room + 2)
        return SpecWarmupReport(0, 0, 0, 0, 0, 0, 0.0)
    use_mrope = executor.model_engine.use_mrope
    done: queue.Queue[LlmResponse] = queue.Queue()
    rid = _REQUEST_ID_BASE
    batches = spec_warmup_batches(max_batch_size)
    lengths = spec_warmup_prompt_lengths(executor.model_engine.max_num_tokens, max_prompt)
    short = min(PROMPT_TOKENS, max_prompt)
    # (requests, prompt length) of each wave
    waves = [(size, short) for size in batches] + [(1, n) for n in lengths]
    decoder.accept_override = _accept_in_turn()
    try:
        for size, prompt_len in tqdm(waves, desc="Warming up speculative steps", leave=False):
            for _ in range(size):
                rid -= 1
                req = _dummy_request(rid, input_processor, use_mrope, max_tokens, prompt_len)
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
                    raise RuntimeError(
                        f"speculative warm-up: a request of a wave of {size} with a "
                        f"{prompt_len}-token prompt failed (a served step of that shape would "
                        f"fail the same way; TRTLLM_WARMUP=0 skips the warm-up): {resp.error}"
                    )
                finished += resp.finished
    finally:
        decoder.accept_override = None
    warmed, decoder.stats = decoder.stats, SpecStats()
    executor.reset_stats()
    report = SpecWarmupReport(
        waves=len(waves),
        requests=sum(size for size, _ in waves),
        verify_rows=warmed.num_verify_rows,
        draft_tokens=warmed.num_draft_tokens,
        accepted_tokens=warmed.num_accepted_tokens,
        replays=warmed.num_replays,
        seconds=time.perf_counter() - start,
    )
    logger.info(
        "speculative warm-up: %d requests in %d waves (batches %s, prompt lengths %s), %d "
        "verify rows, %d of %d drafts accepted, %d rollbacks, in %.1f s",
        report.requests,
        report.waves,
        batches,
        lengths,
        report.verify_rows,
        report.accepted_tokens,
        report.draft_tokens,
        report.replays,
        report.seconds,
    )
    return report
