"""The benchmark workload over HTTP: streaming OpenAI chat requests to a running trtllm-serve.

Each request is one user message: the workload's image(s) as PNG data URLs, then text of
single-token words, sized so that the server's `usage.prompt_tokens` (chat template and vision
tokens included) is `isl`. One probe request measures the fixed part (template + vision) so
the text fills the rest exactly; every timed request reports its prompt tokens back, and the
row carries their mean (`isl_mean`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .metrics import RequestTiming, summarize
from .server_process import ServerProcess
from .sse_client import ServedRequestError, StreamResult, get_body, get_json, post_stream
from .workload import Workload, make_requests, vision_tokens_per_image

CHAT_PATH = "/v1/chat/completions"
_PROBE_WORDS = 8
# The server's per-request stages before the first token (trtllm_request_stage_seconds).
STAGES = ("parse", "media", "prepare", "first_token", "engine_queue", "engine_prefill")
STAGE_COLUMNS = tuple(f"{stage}_ms_mean" for stage in STAGES)


@dataclass(frozen=True)
class ServedTarget:
    host: str
    port: int
    model: str


def parse_served_url(url: str) -> tuple[str, int]:
    """'http://host:port' (a trailing '/' or '/v1' is fine) -> (host, port)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--served_url must look like http://host:port, got {url!r}")
    if parts.path.rstrip("/") not in ("", "/v1") or parts.query:
        raise ValueError(f"--served_url takes the server's root (http://host:port), got {url!r}")
    return parts.hostname, parts.port or 80


def connect(host: str, port: int) -> ServedTarget:
    """The target at host:port, with the model id the server reports."""
    try:
        healthy = get_json(host, port, "/health") is not None
        models = get_json(host, port, "/v1/models") if healthy else None
    except OSError as exc:
        raise RuntimeError(f"no trtllm-serve answers at http://{host}:{port}: {exc}") from None
    if not healthy or not models or not models.get("data"):
        raise RuntimeError(f"the server at http://{host}:{port} is not healthy or lists no model")
    return ServedTarget(host, port, str(models["data"][0]["id"]))


@contextmanager
def served_target(
    served_url: str | None, serve_flags: list[str], log_path: Path, startup_timeout: float
) -> Iterator[ServedTarget]:
    """Connect to `served_url`, or run a `trtllm-serve` child for the duration of the block."""
    if served_url:
        yield connect(*parse_served_url(served_url))
        return
    server = ServerProcess(serve_flags, log_path)
    print(f"trtllm-serve child pid {server.pid} on port {server.port}, log {log_path}", flush=True)
    try:
        server.wait_ready(startup_timeout)
        yield connect(server.host, server.port)
    finally:
        code = server.stop()
        print(f"trtllm-serve child {server.pid} stopped (exit code {code})", flush=True)


def single_token_words(tokenizer_json: Path, limit: int = 4096) -> list[str]:
    """Alphabetic words that the tokenizer encodes, after a space, as exactly one token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    texts = [tok.decode([i]) for i in range(tok.get_vocab_size(with_added_tokens=False))]
    candidates = [t for t in texts if len(t) > 1 and t[0] == " " and t[1:].isascii()]
    candidates = [t for t in candidates if t[1:].isalpha()]
    encoded = tok.encode_batch(candidates, add_special_tokens=False)
    words = [t[1:] for t, enc in zip(candidates, encoded, strict=True) if len(enc.ids) == 1]
    if len(words) < 8:
        raise ValueError(f"{tokenizer_json} has too few single-token words to size prompts")
    return sorted(set(words))[:limit]


def png_data_url(image: Any) -> str:
    buf = io.BytesIO()
    # Level 1: the benchmark's own encoding stays quick; the server decodes it either way.
    image.save(buf, "PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def build_contents(
    config: Any, workload: Workload, words: list[str], num_text: int
) -> list[list[dict[str, Any]]]:
    """Message contents: the in-process workload's images as data URLs, then `num_text` words."""
    rng = np.random.default_rng(workload.seed + 1)
    contents = []
    for images in workload_images(config, workload):
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": png_data_url(image)}} for image in images
        ]
        # A leading space on every word: each is then one token, whatever precedes it.
        text = "".join(" " + words[i] for i in rng.integers(0, len(words), num_text))
        parts.append({"type": "text", "text": text})
        contents.append(parts)
    return contents


def workload_images(config: Any, workload: Workload) -> list[list[Any]]:
    """The in-process workload's images (same generator and seed), per request."""
    # make_requests also draws token-id text, sized by isl; only its images are used here, so
    # ask for the smallest prompt that fits them.
    per_image = vision_tokens_per_image(config, workload.image_size) + 2
    small = replace(workload, isl=workload.images_per_request * per_image + 1)
    return [req["multi_modal_data"].get("image", []) for req in make_requests(config, small)]


def chat_body(
    target: ServedTarget,
    content: list[dict[str, Any]],
    max_tokens: int,
    ignore_eos: bool,
    guided_json: str | None = None,
) -> bytes:
    """One user message with `content` (parts)."""
    messages = [{"role": "user", "content": content}]
    return messages_body(target, messages, max_tokens, ignore_eos, guided_json)


def messages_body(
    target: ServedTarget,
    messages: list[dict[str, Any]],
    max_tokens: int,
    ignore_eos: bool,
    guided_json: str | None = None,
) -> bytes:
    """A streaming chat request of a whole conversation (e.g. a multi-turn history)."""
    body: dict[str, Any] = {
        "model": target.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if guided_json:
        schema = json.loads(guided_json)
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": schema},
        }
    return json.dumps(body).encode("utf-8")


def text_tokens_for_isl(
    target: ServedTarget, config: Any, workload: Workload, words: list[str]
) -> int:
    """How many words make the prompt `isl` tokens: one probe measures the rest of it."""
    probe = build_contents(config, replace(workload, num_requests=1), words, _PROBE_WORDS)[0]
    body = chat_body(target, probe, 1, True)
    result = asyncio.run(post_stream(target.host, target.port, CHAT_PATH, body))
    if result.prompt_tokens < 0:
        raise ServedRequestError("the server sent no usage chunk (stream_options.include_usage)")
    fixed = result.prompt_tokens - _PROBE_WORDS
    if workload.isl - fixed < 1:
        raise ValueError(
            f"isl {workload.isl} leaves no room for text: the chat template and "
            f"{workload.images_per_request} image(s) already take {fixed} tokens"
        )
    return workload.isl - fixed


async def _run_wave(
    target: ServedTarget, bodies: list[bytes], concurrency: int
) -> list[StreamResult]:
    gate = asyncio.Semaphore(concurrency)

    async def guarded(body: bytes) -> StreamResult:
        async with gate:
            return await post_stream(target.host, target.port, CHAT_PATH, body)

    return list(await asyncio.gather(*(guarded(b) for b in bodies)))


def stream_timing(res: StreamResult) -> RequestTiming:
    first = res.first_token if res.first_token is not None else res.end
    return RequestTiming(res.start, first, res.end, res.completion_tokens, res.last_token)


def scrape(target: ServedTarget) -> dict[str, float] | None:
    """The server's /metrics samples ({'name{labels}': value}); None if it has none."""
    from ..serve.metrics import parse_prometheus

    body = get_body(target.host, target.port, "/metrics")
    return None if body is None else parse_prometheus(body.decode())


def server_cpu_pct(
    before: dict[str, float] | None, after: dict[str, float] | None, wall_s: float
) -> float:
    """The server process's CPU time over the wave's wall time, in % of one core (nan when
    the server does not report it): near 100 the front end, not the GPU, sets the pace."""
    from ..serve.metrics import PROCESS_CPU

    if before is None or after is None or PROCESS_CPU not in before or PROCESS_CPU not in after:
        return float("nan")
    return 100.0 * (after[PROCESS_CPU] - before[PROCESS_CPU]) / wall_s


def server_seq_slots(samples: dict[str, float] | None) -> float:
    """The server's seq slots (`trtllm_seq_slots_total`): how many requests it runs at once
    (nan when it does not say)."""
    from ..serve.metrics import PREFIX

    if samples is None:
        return float("nan")
    values = [v for k, v in samples.items() if k.split("{")[0] == f"{PREFIX}seq_slots_total"]
    return float(sum(values)) if values else float("nan")


def queue_note(concurrency: int, slots: float) -> str | None:
    """A line for a wave larger than the server's slots (None otherwise): the rest of the
    wave waits in the server's queue, which the TTFT then shows."""
    if not slots == slots or concurrency <= slots:  # nan: unknown
        return None
    return (
        f"note: the server runs at most {int(slots)} requests at a time (seq slots); "
        f"{concurrency - int(slots)} of the c={concurrency} wave wait in its queue"
    )


def stage_sums(samples: dict[str, float] | None) -> dict[str, tuple[float, float]] | None:
    """{stage: (sum s, count)} from a /metrics scrape (None: the server has none)."""
    if samples is None:
        return None
    out = {}
    for stage in STAGES:
        sums = [v for k, v in samples.items() if _is_stage(k, "sum", stage)]
        counts = [v for k, v in samples.items() if _is_stage(k, "count", stage)]
        out[stage] = (sum(sums), sum(counts))
    return out


def _is_stage(key: str, what: str, stage: str) -> bool:
    return key.startswith(f"trtllm_request_stage_seconds_{what}{{") and f'stage="{stage}"' in key


def stage_means(
    before: dict[str, tuple[float, float]] | None, after: dict[str, tuple[float, float]] | None
) -> dict[str, float]:
    """Mean ms per request in each server stage between two scrapes (nan when unknown)."""
    row = {}
    for stage, column in zip(STAGES, STAGE_COLUMNS, strict=True):
        if before is None or after is None:
            row[column] = float("nan")
            continue
        total = after[stage][0] - before[stage][0]
        count = after[stage][1] - before[stage][1]
        row[column] = 1000.0 * total / count if count else float("nan")
    return row


def run_served_concurrency(
    target: ServedTarget,
    contents: list[list[dict[str, Any]]],
    workload: Workload,
    concurrency: int,
) -> dict[str, float]:
    """One row of the table, over HTTP; the bodies are encoded before the clock starts.

    The row also carries the server's own mean time per stage before the first token
    (`STAGE_COLUMNS`, from its /metrics around the wave): where the TTFT goes; and the
    server process's CPU share during the wave (`server_cpu_pct`) and its seq slots
    (`server_seq_slots`; a wave larger than them queues, and a line says so)."""
    bodies = [
        chat_body(target, c, workload.osl, workload.ignore_eos, workload.guided_json)
        for c in contents
    ]
    before = scrape(target)
    start = time.perf_counter()
    results = asyncio.run(_run_wave(target, bodies, concurrency))
    wall = time.perf_counter() - start
    after = scrape(target)
    row = summarize([stream_timing(r) for r in results], wall, concurrency)
    row["isl_mean"] = float(np.mean([r.prompt_tokens for r in results]))
    row.update(stage_means(stage_sums(before), stage_sums(after)))
    row["server_cpu_pct"] = server_cpu_pct(before, after, wall)
    row["server_seq_slots"] = server_seq_slots(after)
    note = queue_note(concurrency, row["server_seq_slots"])
    if note is not None:
        print(note, flush=True)
    return row


def warm_up_served(target: ServedTarget, contents: list[list[dict[str, Any]]]) -> None:
    """A few short requests first, as in-process: capture and autotuning stay out of the row."""
    bodies = [chat_body(target, c, 8, True) for c in contents[:4]]
    asyncio.run(_run_wave(target, bodies, len(bodies)))
