"""Startup warm-up: run one step of every shape class so no served step compiles or tunes.

`create_py_executor` calls `run_warmup` (on CUDA by default) after the KV cache is sized and the
decode graphs are captured, so each warm-up step takes the path a served step of its shape takes
(decode graph, piecewise graphs, eager). The steps come from `warmup_shapes.warmup_steps` and run
through the real engine with dummy requests, as the capacity probe does. Before the first
forward (`StartupTuning.begin`, ahead of the graph captures and the probe) fla's autotuners get
bucketed keys and the tuned configs of earlier starts (`triton_autotune`); after the warm-up the
configs are written back, so a second start benchmarks nothing. Once the executor runs,
its loop thread is armed in the step compile guard (`TRTLLM_FAIL_ON_STEP_COMPILE=1` then fails a
step that compiles). `TRTLLM_WARMUP=0` skips the warm-up, `=1` runs it on the CPU too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ...inputs.multimodal import MultimodalParams
from ..modules.gated_delta_rule import fla_available
from ..step_compile_guard import STEP_COMPILE_GUARD
from ..triton_autotune import (
    AutotuneDiskCache,
    BucketedConfigCache,
    default_cache_dir,
    find_autotuners,
    fingerprint,
    install_bucketed_caches,
)
from .llm_request import LlmRequest
from .model_engine import PyTorchModelEngine
from .resource_manager import KVCacheManager, SeqSlotManager
from .scheduler import ScheduledRequests
from .warmup_shapes import StepLimits, StepShape, warmup_steps

logger = logging.getLogger(__name__)

ENV_WARMUP = "TRTLLM_WARMUP"
_WARMUP_REQUEST_ID_BASE = -2_000_000  # below the capacity probe's ids


def warmup_enabled(device: torch.device) -> bool:
    """`TRTLLM_WARMUP`: unset runs the warm-up on CUDA only (nothing compiles on the CPU);
    "0" skips it; "1" runs it on any device (the CPU tests)."""
    value = os.environ.get(ENV_WARMUP, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_WARMUP} must be 0 or 1, got {value!r}")
    return value == "1" or (value == "" and device.type == "cuda")


@dataclass(frozen=True)
class WarmupReport:
    steps_run: int
    steps_skipped: int  # beyond the KV cache or seq slots: the scheduler cannot make them either
    seconds: float
    compiles: int  # Triton JIT compiles since StartupTuning.begin (probe, graphs, warm-up)
    autotunes: int  # autotune benchmarks since then (0 on a second start)
    configs_loaded: int  # tuned configs read from the disk cache
    cache_path: Path | None


def _longest_chunk(max_seq_len: int) -> int:
    """The longest dummy chunk: a prompt, one decode position and the overlap's spare token."""
    return max(1, max_seq_len - 2)


def step_limits(engine: PyTorchModelEngine, max_batch_size: int, max_seq_len: int) -> StepLimits:
    """The started engine's step bounds and graph paths."""
    graphs = engine.cuda_graph_runner
    piecewise = engine.piecewise_graph_runner
    return StepLimits(
        max_num_tokens=engine.max_num_tokens,
        max_batch_size=max_batch_size,
        decode_graph_sizes=tuple(graphs.batch_sizes) if graphs is not None else (),
        decode_graph_padding=graphs.enable_padding if graphs is not None else True,
        piecewise_max_tokens=piecewise.buckets[-1] if piecewise is not None else 0,
        max_chunk_tokens=min(engine.max_num_tokens, _longest_chunk(max_seq_len)),
        recurrent_rows=engine.model.is_hybrid,
    )


def dummy_prompt(
    input_processor: Any, num_tokens: int, use_mrope: bool
) -> tuple[list[int], MultimodalParams | None]:
    """A `num_tokens`-token text prompt of the processor's dummy ids, with its mRoPE
    positions when the model takes them (the warm-ups' requests)."""
    ids = list(input_processor.get_dummy_prompt(num_tokens))[:num_tokens]
    if not use_mrope:
        return ids, None
    ids, extra = input_processor({"prompt_token_ids": ids}, None)
    return ids, MultimodalParams(extra["multimodal_data"])


class _DummyRequests:
    """Makes and frees the warm-up's dummy requests (KV blocks and seq slots included)."""

    def __init__(
        self,
        engine: PyTorchModelEngine,
        input_processor: Any,
        kv: KVCacheManager,
        max_batch_size: int,
    ) -> None:
        self.engine, self.input_processor, self.kv = engine, input_processor, kv
        self.slots = SeqSlotManager(max_batch_size)  # the scheduler's slots
        self._next_id = _WARMUP_REQUEST_ID_BASE

    def make(
        self, num_tokens: int, carried: bool = False, prefill: bool = True
    ) -> LlmRequest | None:
        """A context request whose next chunk is `num_tokens` long, or None when the KV cache
        is full. `carried`: one more prompt token, prefilled as a first chunk (here, unless
        `prefill` is False: the caller's `_prefill_first`), so the chunk continues the request
        (cached KV, recurrent state carried over)."""
        prompt_len = num_tokens + int(carried)
        ids, params = dummy_prompt(self.input_processor, prompt_len, self.engine.use_mrope)
        self._next_id -= 1
        req = LlmRequest(self._next_id, ids, multimodal_params=params)
        # prompt, one decode position, the overlap's spare token
        if self.slots.num_free == 0 or not self.kv.add_tokens(req.request_id, req.prompt_len + 2):
            self.kv.free(req.request_id)
            return None
        req.seq_slot = self.slots.acquire(req.request_id)
        # A carried request's first chunk is its first token, prefilled by `_prefill_first`.
        req.context_chunk_size = 1 if carried else req.context_remaining_length
        if carried and prefill:
            self._prefill_first([req])
        return req

    def _prefill_first(self, reqs: list[LlmRequest]) -> None:
        """The first token of each carried request, one step for all of them; their next
        chunk is then the rest of their prompt."""
        self.engine.forward(ScheduledRequests(context_requests=reqs))
        for req in reqs:
            req.move_to_next_context_chunk()
            req.context_chunk_size = req.context_remaining_length

    def make_all(self, sizes: list[int], carried: int = 0) -> list[LlmRequest] | None:
        """One request per size (the first `carried` of them carried), or None (and nothing
        held) when they do not all fit."""
        reqs: list[LlmRequest] = []
        for i, n in enumerate(sizes):
            req = self.make(n, i < carried, prefill=False)
            if req is None:
                self.free(reqs)
                return None
            reqs.append(req)
        if carried:
            self._prefill_first(reqs[:carried])
        return reqs

    def free(self, reqs: list[LlmRequest]) -> None:
        for req in reqs:
            self.kv.free(req.request_id)
            self.slots.release(req.request_id)


def _grow_generation_pool(
    engine: PyTorchModelEngine, dummies: _DummyRequests, pool: list[LlmRequest], size: int
) -> None:
    """Grow `pool` to `size` one-token requests in generation (prefilled together; fewer when
    the KV cache is full). Generation steps never append their token, so the pool's
    requests keep this length for every step."""
    new: list[LlmRequest] = []
    while len(pool) + len(new) < size:
        req = dummies.make(1)
        if req is None:
            break
        new.append(req)
    step = engine.max_num_tokens  # one token each: at most max_num_tokens requests a step
    for i in range(0, len(new), step):
        engine.forward(ScheduledRequests(context_requests=new[i : i + step]))
    for req in new:
        req.add_new_token(0)
    pool.extend(new)


def _chunk_sizes(num_tokens: int, longest: int, num_chunks: int = 1) -> list[int]:
    """`num_tokens` as context chunks of at most `longest` tokens (one request each): a step
    longer than max_seq_len is several requests' chunks, as the scheduler would pack it; split
    evenly over `num_chunks` when that is more (a `rows` step)."""
    full, rest = divmod(num_tokens, longest)
    sizes = [longest] * full + ([rest] if rest else [])
    if len(sizes) >= num_chunks:
        return sizes
    base, extra = divmod(num_tokens, num_chunks)
    return [base + 1] * extra + [base] * (num_chunks - extra)


def _carried_chunks(shape: StepShape, num_chunks: int) -> int:
    """How many of the step's chunks continue their request: all in a `rows` step."""
    return num_chunks if shape.rows else int(shape.carried)


def _run_steps(
    engine: PyTorchModelEngine,
    input_processor: Any,
    kv: KVCacheManager,
    limits: tuple[int, int],
    steps: list[StepShape],
) -> tuple[int, int]:
    """Run `steps` (decode-only ones last: their pool may take every seq slot); returns
    (run, skipped). `limits` is (max_batch_size, max_seq_len)."""
    max_batch_size, max_seq_len = limits
    dummies = _DummyRequests(engine, input_processor, kv, max_batch_size)
    pool: list[LlmRequest] = []
    run = skipped = 0
    ordered = sorted(steps, key=lambda s: s.num_contexts == 0)  # stable: sizes stay ascending
    try:
        for shape in tqdm(ordered, desc="Warming up kernels", leave=False):
            _grow_generation_pool(engine, dummies, pool, shape.num_generations)
            longest = _longest_chunk(max_seq_len) - int(shape.carried)  # + the first chunk
            sizes = _chunk_sizes(shape.num_context_tokens, max(1, longest), shape.num_contexts)
            carried = _carried_chunks(shape, len(sizes))
            fits = len(sizes) + shape.num_generations <= max_batch_size
            ctx = dummies.make_all(sizes, carried) if fits else None
            if ctx is None and fits and len(pool) > shape.num_generations:
                # The pool's rows this step does not use hold blocks and slots it needs.
                dummies.free(pool[shape.num_generations :])
                del pool[shape.num_generations :]
                ctx = dummies.make_all(sizes, carried)
            if ctx is None or shape.num_generations > len(pool):
                skipped += 1  # beyond the KV cache or the seq slots: no scheduler makes it
                dummies.free(ctx or [])
                continue
            try:
                engine.forward(
                    ScheduledRequests(
                        context_requests=ctx, generation_requests=pool[: shape.num_generations]
                    )
                )
            finally:
                dummies.free(ctx)
            run += 1
    finally:
        dummies.free(pool)
    return run, skipped


def _cache_for(device: torch.device) -> AutotuneDiskCache:
    name = torch.cuda.get_device_name(device)
    capability = torch.cuda.get_device_capability(device)
    return AutotuneDiskCache(default_cache_dir(), fingerprint(name, capability))


@dataclass
class StartupTuning:
    """Everything that compiles or tunes from model build to the end of the warm-up.

    Begun before the capacity probe and the graph captures, which run fla's kernels first: its
    autotuners must have their bucketed caches and the disk cache's configs by then, or the
    probe would benchmark (again, on a second start) and its results would bypass the count.
    """

    caches: dict[str, BucketedConfigCache]
    disk_cache: AutotuneDiskCache | None
    configs_loaded: int
    compiles_at_start: int
    autotunes_at_start: int

    @classmethod
    def begin(
        cls, device: torch.device, disk_cache: AutotuneDiskCache | None = None
    ) -> StartupTuning:
        """`disk_cache` defaults to this GPU's and these versions' on CUDA; on the CPU nothing
        autotunes and no cache is used."""
        if disk_cache is None and device.type == "cuda":
            disk_cache = _cache_for(device)
        guard = STEP_COMPILE_GUARD
        guard.install()
        fla_available()  # imports fla's kernels (when installed), so their autotuners are found
        tuners = find_autotuners()
        caches = install_bucketed_caches(tuners)
        for cache in caches.values():
            cache.on_new_key = guard.on_autotune
        loaded = disk_cache.load_into(tuners, caches) if disk_cache is not None else 0
        return cls(caches, disk_cache, loaded, guard.num_compiles, guard.num_autotunes)

    def counts(self) -> tuple[int, int]:
        """(Triton compiles, autotune benchmarks) since `begin`."""
        guard = STEP_COMPILE_GUARD
        return (
            guard.num_compiles - self.compiles_at_start,
            guard.num_autotunes - self.autotunes_at_start,
        )

    def save(self) -> None:
        """Write the tuned configs back when anything was tuned since `begin`."""
        if self.disk_cache is None or not self.counts()[1]:
            return
        try:
            self.disk_cache.save_from(self.caches)
        except OSError as exc:  # a read-only home: this start is fine, the next re-tunes
            logger.warning("autotune cache %s not written: %s", self.disk_cache.path, exc)


def run_warmup(
    engine: PyTorchModelEngine,
    input_processor: Any,
    kv: KVCacheManager,
    max_batch_size: int,
    max_seq_len: int,
    tuning: StartupTuning | None = None,
) -> WarmupReport:
    """Warm every shape class up (see the module doc). `tuning` is the one begun before the
    capacity probe (`create_py_executor`); a new one otherwise. Its counts cover the whole
    startup since it began."""
    start = time.perf_counter()
    if tuning is None:
        tuning = StartupTuning.begin(engine.device)
    steps = warmup_steps(step_limits(engine, max_batch_size, max_seq_len))
    run, skipped = _run_steps(engine, input_processor, kv, (max_batch_size, max_seq_len), steps)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    compiles, autotunes = tuning.counts()
    disk = tuning.disk_cache
    report = WarmupReport(
        steps_run=run,
        steps_skipped=skipped,
        seconds=time.perf_counter() - start,
        compiles=compiles,
        autotunes=autotunes,
        configs_loaded=tuning.configs_loaded,
        cache_path=disk.path if disk is not None else None,
    )
    tuning.save()
    logger.info(
        "warm-up: %d steps (%d skipped: beyond the KV cache or seq slots) in %.1f s; startup: "
        "%d Triton compiles, %d autotune benchmarks, %d tuned configs read from %s",
        report.steps_run,
        report.steps_skipped,
        report.seconds,
        report.compiles,
        report.autotunes,
        report.configs_loaded,
        report.cache_path or "no disk cache",
    )
    return report


def arm_step_compile_guard(thread: threading.Thread | None) -> None:
    """After warm-up: compiles on the executor's loop thread are served-step compiles."""
    if thread is not None:
        STEP_COMPILE_GUARD.arm(thread)
