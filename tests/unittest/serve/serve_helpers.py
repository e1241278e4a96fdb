"""Shared helpers of the serve tests: a real uvicorn server in a thread, media builders."""

from __future__ import annotations

import base64
import io
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn
from PIL import Image

from tensorrt_llm.commands.serve import llm_kwargs, parse_args, resolve_model_dir
from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.serve import build_app
from tensorrt_llm.serve.lifecycle import make_server
from tensorrt_llm.serve.metrics import parse_prometheus


@dataclass
class ServeHandle:
    """A running server: its URL, served model id, and the LLM behind it."""

    base_url: str
    model: str
    llm: Any
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, **kwargs: Any) -> openai.OpenAI:
        # max_retries=0: a 5xx or a dropped connection must fail the test, not be retried away.
        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kwargs
        )

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kwargs
        )

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        return parse_prometheus(text)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not shut down"


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total, found = 0.0, False
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total, found = total + value, True
    assert found, f"metric {name} {labels} not exported"
    return total


def start_server(cli_args: list[str], graceful_s: float = 10.0, llm: Any = None) -> ServeHandle:
    """Serve `cli_args` in a thread. Given an `llm`, the server reuses it and leaves it running
    when it stops (the LLM flags among `cli_args` are then ignored)."""
    args = parse_args(cli_args)
    if llm is None:
        llm = LLM(model=resolve_model_dir(args), **llm_kwargs(args))
    else:
        args.shutdown_llm = False
    app = build_app(llm, args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(
        app,
        app.state.server.drain,
        header_read_timeout_s=args.header_read_timeout,
        log_level="warning",
        timeout_graceful_shutdown=graceful_s,
        lifespan="on",
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    model = app.state.server.model_name
    return ServeHandle(f"http://127.0.0.1:{port}", model, llm, server, thread)


def wait_until_idle(handle: ServeHandle, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until every seq slot and KV block is free; return the last samples."""
    deadline = time.monotonic() + timeout
    while True:
        samples = handle.metrics()
        idle = (
            metric(samples, "trtllm_seq_slots_free") == metric(samples, "trtllm_seq_slots_total")
            and metric(samples, "trtllm_kv_cache_free_blocks")
            == metric(samples, "trtllm_kv_cache_total_blocks")
            and metric(samples, "trtllm_kv_cache_usage_ratio") == 0
            and metric(samples, "trtllm_num_requests_running") == 0
            and metric(samples, "trtllm_num_requests_waiting") == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


# ---------------------------------------------------------------- media


def png_bytes(
    size: tuple[int, int] = (64, 48), color: tuple[int, int, int] = (200, 10, 30)
) -> bytes:
    image = Image.new("RGB", size, color)
    # A gradient, so images of one size but different content give different pixels.
    for x in range(0, size[0], 4):
        image.putpixel((x, x % size[1]), (x % 256, 255 - x % 256, 7))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def gif_bytes(
    num_frames: int = 4, size: tuple[int, int] = (56, 56), duration_ms: int = 500
) -> bytes:
    frames = [Image.new("RGB", size, (40 * i, 100, 255 - 40 * i)) for i in range(num_frames)]
    buf = io.BytesIO()
    frames[0].save(
        buf, "GIF", save_all=True, append_images=frames[1:], duration=duration_ms, loop=0
    )
    return buf.getvalue()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict[str, Any] | str) -> list[dict[str, Any]]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


# ---------------------------------------------------------------- the real command


def spawn_server(extra_args: list[str]) -> tuple[subprocess.Popen, str, str]:
    """`python -m tensorrt_llm.commands.serve --demo --device cpu ...` on a free loopback port,
    waited for until /health answers: (process, base URL, model id). The caller stops it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "tensorrt_llm.commands.serve", "--demo", "--device", "cpu"]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--log_level", "warning", *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()[-2000:])  # type: ignore[union-attr]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.2)
        model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, base, model
