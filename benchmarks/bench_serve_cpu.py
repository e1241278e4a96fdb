"""The server process's CPU time per streamed token (CPU only, no GPU needed).

    python benchmarks/bench_serve_cpu.py [--streams 32] [--max_tokens 128] [--rounds 3] \
        [--serve_args "--stream_interval 4"]

Starts `trtllm-serve` on a tiny Qwen3-VL checkpoint on the CPU (the engine in its own process,
the default; `bench/served.py`'s child), sends `--streams` concurrent streaming chat requests of
`--max_tokens` tokens (`ignore_eos`), and reads the server process's CPU time
(`process_cpu_seconds_total` of its /metrics) around each round. The engine's process is not
counted: the figure is the front end's work per token (HTTP, detokenizing, SSE chunks, socket
writes), what limits a large batch of streams once the GPU is fast enough.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from pathlib import Path

import httpx

from tensorrt_llm.bench.served import ServedTarget, scrape, served_target
from tensorrt_llm.serve.metrics import PROCESS_CPU
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


def cpu_seconds(target: ServedTarget) -> float:
    """The server process's CPU seconds so far, from its /metrics."""
    samples = scrape(target)
    if samples is None or PROCESS_CPU not in samples:
        raise SystemExit(f"the server reports no {PROCESS_CPU}")
    return samples[PROCESS_CPU]


async def stream(client: httpx.AsyncClient, target: ServedTarget, i: int, max_tokens: int) -> int:
    """One streaming chat request; the number of content chunks it got."""
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": f"tell me story number {i}"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    chunks = 0
    url = f"http://{target.host}:{target.port}/v1/chat/completions"
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                chunks += bool(choices[0].get("delta", {}).get("content"))
    return chunks


async def run_round(target: ServedTarget, streams: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await stream(client, target, -1, 4)  # warm
        cpu0, t0 = cpu_seconds(target), time.perf_counter()
        chunks = await asyncio.gather(
            *(stream(client, target, i, max_tokens) for i in range(streams))
        )
        cpu1, t1 = cpu_seconds(target), time.perf_counter()
    tokens = streams * max_tokens
    return {
        "seconds": t1 - t0,
        "server_cpu_s": cpu1 - cpu0,
        "server_cpu_ms_per_token": 1e3 * (cpu1 - cpu0) / tokens,
        "content_chunks": sum(chunks),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve_args", default="", help="extra trtllm-serve flags, one string")
    p.add_argument("--output", help="write the rounds as JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint("qwen3_vl", Path(tmp) / "ckpt")
        flags = [str(ckpt), "--device", "cpu", "--max_batch_size", str(args.streams)]
        flags += shlex.split(args.serve_args)
        with served_target(None, flags, Path(tmp) / "serve.log", 300.0) as target:
            rounds = [
                asyncio.run(run_round(target, args.streams, args.max_tokens))
                for _ in range(args.rounds)
            ]
    for r in rounds:
        print(
            f"{args.streams} streams x {args.max_tokens} tokens in {r['seconds']:.2f} s: server "
            f"CPU {r['server_cpu_s']:.2f} s, {r['server_cpu_ms_per_token']:.3f} ms a token "
            f"({r['content_chunks']} content chunks)",
            flush=True,
        )
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
