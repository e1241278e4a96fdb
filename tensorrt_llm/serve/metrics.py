"""Prometheus metrics of the server, rendered in the text exposition format (no client library).

Counters and histograms are updated by the request handlers (all on the event loop; a lock
still guards them so a scrape from another thread reads a consistent set). Executor gauges
(running/waiting requests, KV-cache usage, free seq slots) are read from a stats callback at
scrape time, so they are never stale.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

PREFIX = "trtllm_"
PROCESS_CPU = "process_cpu_seconds_total"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
)
# Where a request's time goes before its first token, in order (the `stage` label):
# parse: body read, JSON decode, validation; media: fetching images/videos and, without a
# preprocess pool, decoding them (a pool decodes in its workers, inside "prepare");
# prepare: chat template, tokenization, the HF processor, the engine's checks, the enqueue;
# first_token: from the enqueue to the first token seen by the handler (engine queue, prefill,
# delivery). Two engine stages split it, from the engine's stamps (`RequestOutput.metrics`),
# recorded when the request finishes: engine_queue, from the engine request's arrival to its
# first scheduled prompt chunk; engine_prefill, from there to its first token.
REQUEST_STAGES = ("parse", "media", "prepare", "first_token", "engine_queue", "engine_prefill")
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# (metric name, help, stats field); every field is optional on the stats object.
_EXECUTOR_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("num_requests_running", "Requests holding a seq slot in the executor.", "num_running"),
    ("num_requests_waiting", "Requests accepted but not yet scheduled.", "num_waiting"),
    ("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", "kv_cache_usage"),
    (
        "kv_cache_free_blocks",
        "Free KV-cache blocks (cached prefix blocks no request holds included).",
        "num_free_kv_blocks",
    ),
    ("kv_cache_total_blocks", "Total KV-cache blocks.", "num_total_kv_blocks"),
    ("seq_slots_free", "Free sequence slots.", "num_free_seq_slots"),
    ("seq_slots_total", "Total sequence slots.", "num_total_seq_slots"),
)
_EXECUTOR_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("executor_steps_total", "Executor iterations run.", "num_steps"),
    ("executor_requests_completed_total", "Requests that finished normally.", "num_completed"),
    ("executor_requests_failed_total", "Requests that failed in the executor.", "num_failed"),
    (
        "executor_requests_cancelled_total",
        "Requests cancelled (e.g. client gone).",
        "num_cancelled",
    ),
    (
        "executor_preemptions_total",
        "Running requests preempted (KV freed, recomputed later) because the KV cache ran out.",
        "num_preemptions",
    ),
    (
        "prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache (KV block reuse) at first admission.",
        "prefix_cache_queries",
    ),
    (
        "prefix_cache_hits_total",
        "Of the prefix-cache queries, prompt tokens whose KV came from the cache.",
        "prefix_cache_hits",
    ),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: `le` buckets plus +Inf)."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = sorted(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # last = beyond the largest bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        if times < 1 or not math.isfinite(value):
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, name: str, base: dict[str, str]) -> list[str]:
        lines, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            lines.append(f"{name}_bucket{_labels({**base, 'le': _num(bound)})} {running}")
        lines.append(f"{name}_bucket{_labels({**base, 'le': '+Inf'})} {self.count}")
        lines.append(f"{name}_sum{_labels(base)} {_num(self.sum)}")
        lines.append(f"{name}_count{_labels(base)} {self.count}")
        return lines


class ServerMetrics:
    """All server metrics. `stats_fn` returns the executor's stats object (or None)."""

    def __init__(self, model_name: str, stats_fn: Callable[[], Any] | None = None) -> None:
        self.model_name = model_name
        self.stats_fn = stats_fn
        self._lock = threading.Lock()
        self._http: dict[tuple[str, str], int] = {}  # (endpoint, status code) -> count
        self._finished: dict[str, int] = {}  # finish_reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.in_flight = 0
        self.event_loop_lag_s = 0.0  # set by the app's lag monitor
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.stages = {stage: Histogram(STAGE_BUCKETS) for stage in REQUEST_STAGES}

    # ---- updates -------------------------------------------------------------------------------
    def on_http(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self._http[key] = self._http.get(key, 0) + 1

    def set_event_loop_lag(self, seconds: float) -> None:
        with self._lock:
            self.event_loop_lag_s = seconds

    def on_request_start(self) -> None:
        with self._lock:
            self.in_flight += 1

    def on_request_end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def on_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def on_stage(self, stage: str, seconds: float) -> None:
        """One request spent `seconds` in `stage` (one of REQUEST_STAGES)."""
        with self._lock:
            self.stages[stage].observe(seconds)

    def on_engine_metrics(self, m: Any) -> None:
        """The engine stages of one finished request (`RequestMetrics`), where it got there."""
        scheduled, first = m.first_scheduled_time, m.first_token_time
        if scheduled is None:
            return
        with self._lock:
            self.stages["engine_queue"].observe(scheduled - m.arrival_time)
            if first is not None:
                self.stages["engine_prefill"].observe(first - scheduled)

    def on_tokens(self, gap_s: float, num_tokens: int) -> None:
        """`num_tokens` arrived `gap_s` after the previous update: each counts gap/num once."""
        if num_tokens > 0:
            with self._lock:
                self.itl.observe(gap_s / num_tokens, times=num_tokens)

    def on_request_done(
        self,
        finish_reasons: Iterable[str | None],
        prompt_tokens: int,
        gen_tokens: int,
        e2e_s: float,
    ) -> None:
        with self._lock:
            for reason in finish_reasons:
                key = reason or "unknown"
                self._finished[key] = self._finished.get(key, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += gen_tokens
            self.e2e.observe(e2e_s)

    # ---- rendering -----------------------------------------------------------------------------
    def render(self) -> str:
        base = {"model_name": self.model_name}
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> str:
            full = PREFIX + name
            out.append(f"# HELP {full} {help_text}")
            out.append(f"# TYPE {full} {kind}")
            return full

        with self._lock:
            name = family("http_requests_total", "counter", "HTTP requests by endpoint and status.")
            for (endpoint, status), count in sorted(self._http.items()):
                out.append(
                    f"{name}{_labels({**base, 'endpoint': endpoint, 'status': status})} {count}"
                )
            name = family("request_success_total", "counter", "Finished completions by reason.")
            for reason, count in sorted(self._finished.items()):
                out.append(f"{name}{_labels({**base, 'finish_reason': reason})} {count}")
            for metric, help_text, value in (
                (
                    "prompt_tokens_total",
                    "Prompt tokens processed (vision tokens included).",
                    self.prompt_tokens,
                ),
                ("generation_tokens_total", "Tokens generated.", self.generation_tokens),
            ):
                out.append(f"{family(metric, 'counter', help_text)}{_labels(base)} {value}")
            name = family("num_requests_in_flight", "gauge", "HTTP requests being served.")
            out.append(f"{name}{_labels(base)} {self.in_flight}")
            name = family(
                "event_loop_lag_seconds",
                "gauge",
                "Largest delay of the server's asyncio loop over the last second.",
            )
            out.append(f"{name}{_labels(base)} {_num(self.event_loop_lag_s)}")
            # Prometheus's standard process metric (no prefix): the front end's own CPU, which
            # `trtllm-bench --served` turns into the server's CPU share during a wave.
            out.append(
                f"# HELP {PROCESS_CPU} Total user and system CPU time of the server "
                "process in seconds (all its threads: the engine loop's too with executor_mode "
                "inproc, not the engine process's)."
            )
            out.append(f"# TYPE {PROCESS_CPU} counter")
            out.append(f"{PROCESS_CPU} {_num(time.process_time())}")
            for metric, help_text, hist in (
                ("time_to_first_token_seconds", "Time to first token.", self.ttft),
                ("inter_token_latency_seconds", "Time between output tokens.", self.itl),
                ("e2e_request_latency_seconds", "End-to-end request latency.", self.e2e),
            ):
                out.extend(hist.render(family(metric, "histogram", help_text), base))
            name = family(
                "request_stage_seconds",
                "histogram",
                "Time per request in each stage before its first token (see REQUEST_STAGES).",
            )
            for stage, hist in self.stages.items():
                out.extend(hist.render(name, {**base, "stage": stage}))
        self._render_executor(out, family, base)
        return "\n".join(out) + "\n"

    def _render_executor(
        self, out: list[str], family: Callable[[str, str, str], str], base: dict[str, str]
    ) -> None:
        stats = self.stats_fn() if self.stats_fn is not None else None
        if stats is None:
            return
        for table, kind in ((_EXECUTOR_GAUGES, "gauge"), (_EXECUTOR_COUNTERS, "counter")):
            for metric, help_text, field in table:
                value = getattr(stats, field, None)
                if value is None:
                    continue
                out.append(f"{family(metric, kind, help_text)}{_labels(base)} {_num(float(value))}")


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a text exposition as {'name{labels}': value} (comments skipped)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
    return samples
