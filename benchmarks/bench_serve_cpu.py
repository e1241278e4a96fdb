"""The server process's CPU time per streamed token (CPU only, no GPU needed).

    python benchmarks/bench_serve_cpu.py [--streams 32] [--max_tokens 128] [--rounds 3] \
        [--serve_args "--stream_interval 4"]

Starts `trtllm-serve` on a tiny Qwen3-VL checkpoint on the CPU (the engine in its own process,
the default), sends `--streams` concurrent streaming chat requests of `--max_tokens` tokens
(`ignore_eos`), and reads the server process's user + system CPU time from /proc around each
round. The engine's process is not counted: the figure is the front end's work per token (HTTP,
detokenizing, SSE chunks, socket writes), what limits a large batch of streams once the GPU is
fast enough. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int) -> int:
    """One streaming chat request; the number of content chunks it got."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"tell me story number {i}"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    chunks = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                chunks += bool(choices[0].get("delta", {}).get("content"))
    return chunks


async def run_round(url: str, model: str, pid: int, streams: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await stream(client, url, model, -1, 4)  # warm
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        chunks = await asyncio.gather(
            *(stream(client, url, model, i, max_tokens) for i in range(streams))
        )
        cpu1, t1 = cpu_seconds(pid), time.perf_counter()
    tokens = streams * max_tokens
    return {
        "seconds": t1 - t0,
        "server_cpu_s": cpu1 - cpu0,
        "server_cpu_ms_per_token": 1e3 * (cpu1 - cpu0) / tokens,
        "content_chunks": sum(chunks),
    }


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"trtllm-serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("trtllm-serve did not become healthy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=8137)
    p.add_argument("--serve_args", default="", help="extra trtllm-serve flags, one string")
    p.add_argument("--output", help="write the rounds as JSON here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint("qwen3_vl", Path(tmp) / "ckpt")
        cmd = [sys.executable, "-m", "tensorrt_llm.commands.serve", str(ckpt), "--device", "cpu"]
        cmd += ["--port", str(args.port), "--max_batch_size", str(args.streams)]
        cmd += shlex.split(args.serve_args)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{args.port}"
        try:
            wait_healthy(url, proc)
            rounds = [
                asyncio.run(run_round(url, "ckpt", proc.pid, args.streams, args.max_tokens))
                for _ in range(args.rounds)
            ]
        finally:
            proc.terminate()
            proc.wait(60)
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
