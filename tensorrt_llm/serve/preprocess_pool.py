"""Input preparation for trtllm-serve in a pool of worker processes.

Tokenizing chat prompts and running the HF image/video processor are CPU-heavy and hold the
GIL for much of their time; done on the server's own threads they stall the asyncio loop (and,
with the engine in-process, the engine loop too), which showed as multi-second TTFTs for waves
of image requests. Each worker process holds its own tokenizer and input processor (an
`InputPreparer`) and returns the prepared request: token ids, multimodal tensors, sampling
params. The engine-side checks and the submission stay in the server process.

Media fetching stays in the server (async I/O with the address guard); the fetched bytes
travel to the worker (`PendingMedia`), which decodes them, so no decoder runs in the server
process either. Media errors raised there come back as the same MediaError (HTTP 400).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
from typing import Any

from ..llmapi.input_preparer import InputPreparer, PreparedRequest
from ..llmapi.llm_args import LlmArgs
from ..sampling_params import SamplingParams
from .media import MediaConfig, decode_pending

_PREPARER: InputPreparer | None = None
_MEDIA_CONFIG: MediaConfig | None = None


def default_num_workers(device_type: str) -> int:
    """Workers when --num_preprocess_workers is not given: half the cores, at most 8, on CUDA;
    none on CPU, where the engine itself needs the cores.

    NOTE: measured on the H200 (16 cores, Qwen3-VL-8B FP8, 1000/1000, image data URLs, engine in
    its own process): 8 workers gave +4.4% / +5.4% / +4.2% served throughput at c=32/64/128 over
    none (benchmarks/results/qwen3_vl_8b_served_h200.md, run 7).
    """
    if device_type != "cuda":
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _init_worker(args: LlmArgs, max_seq_len: int, media_config: MediaConfig) -> None:
    global _PREPARER, _MEDIA_CONFIG
    import torch

    from ..inputs.registry import create_input_processor, load_tokenizer

    # NOTE: many workers sharing the cores: one intra-op thread each.
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
    processor = create_input_processor(
        args.model, tokenizer=tokenizer, trust_remote_code=args.trust_remote_code
    )
    _PREPARER = InputPreparer(args, tokenizer, processor, max_seq_len)
    _MEDIA_CONFIG = media_config


def _prepare(prompt: Any, params: SamplingParams | None) -> PreparedRequest:
    assert _PREPARER is not None and _MEDIA_CONFIG is not None, "worker not initialised"
    return _PREPARER.prepare(decode_pending(prompt, _MEDIA_CONFIG), params)


def _ready() -> int:
    return os.getpid()


class PreprocessPool:
    """`num_workers` spawned processes running `InputPreparer.prepare`."""

    def __init__(
        self, args: LlmArgs, max_seq_len: int, num_workers: int, media_config: MediaConfig
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"a preprocess pool needs >= 1 worker, got {num_workers}")
        self.num_workers = num_workers
        self._pool = concurrent.futures.ProcessPoolExecutor(
            num_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(args, max_seq_len, media_config),
        )

    async def start(self) -> None:
        """Start every worker now (imports and processor loading take seconds), not on the
        first requests."""
        loop = asyncio.get_running_loop()
        pids = await asyncio.gather(
            *(loop.run_in_executor(self._pool, _ready) for _ in range(self.num_workers * 2))
        )
        if not pids:
            raise RuntimeError("the preprocess pool did not start")

    async def prepare(self, prompt: Any, params: SamplingParams | None) -> PreparedRequest:
        """The prepared request; the worker's ValueError/TypeError re-raised here as is.

        A worker that dies takes the pool down (BrokenProcessPool): that is a server fault and
        surfaces as such."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _prepare, prompt, params)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
