"""Host time of an image data URL in trtllm-serve: the server process's part against the worker's.

    python benchmarks/bench_media_fetch.py [--sizes 512x512 1024x768] [--iters 40]

`fetch_media_url` runs on the server's event loop for every image part of a chat request
(header, MIME and size checks of a data URL); `PendingMedia.decode` runs in a preprocess worker
(base64, then the PNG decoder). At a wave of 128 requests the event loop pays the first part
128 times in a row, so that is the figure to keep small. Random RGB pixels saved as PNG (the
`trtllm-bench --served` workload's format); CPU work, so the CPU figure is the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import time

import httpx
import numpy as np
from PIL import Image

from tensorrt_llm.serve.media import MediaConfig, PendingMedia, fetch_media_url


def png_data_url(width: int, height: int) -> str:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def time_fetch(url: str, config: MediaConfig, iters: int) -> tuple[float, PendingMedia]:
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            await fetch_media_url(url, "image", config, client)
        start = time.perf_counter()
        for _ in range(iters):
            pending = await fetch_media_url(url, "image", config, client)
        return (time.perf_counter() - start) / iters, pending


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["512x512", "1024x768"])
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args()
    config = MediaConfig()
    for size in args.sizes:
        width, height = (int(v) for v in size.split("x"))
        url = png_data_url(width, height)
        fetch_s, pending = asyncio.run(time_fetch(url, config, args.iters))
        start = time.perf_counter()
        for _ in range(max(1, args.iters // 4)):
            pending.decode(config)
        decode_s = (time.perf_counter() - start) / max(1, args.iters // 4)
        print(
            f"{size}: data URL {len(url)} chars; server process {1000 * fetch_s:.2f} ms, "
            f"worker decode {1000 * decode_s:.2f} ms"
        )


if __name__ == "__main__":
    main()
