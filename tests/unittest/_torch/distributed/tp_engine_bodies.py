"""Rank bodies of the engine-level tensor-parallel tests: rank 0 runs a real executor (the
scheduler, the sampler, the KV cache) and broadcasts each step; rank 1 runs the worker loop."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from PIL import Image

from tensorrt_llm._torch.pyexecutor.engine_config import EngineConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.tp_worker import run_tp_worker
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.sampling_params import SamplingParams

PROMPTS = ["hello there, how are you", "a much longer prompt " * 4, "short", "one more"]
MAX_TOKENS = 6


def engine_config(checkpoint_dir: str, **overrides: Any) -> EngineConfig:
    """Two seq slots and 16-token steps: four requests batch, prefill in chunks and reuse
    the slots of finished ones."""
    args = LlmArgs(
        model=checkpoint_dir,
        device="cpu",
        max_batch_size=2,
        max_num_tokens=16,
        **overrides,
    )
    return args.to_engine_config()


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8))


def _requests(proc: Any, with_images: bool) -> list[LlmRequest]:
    inputs: list[dict[str, Any]] = [{"prompt": p} for p in PROMPTS]
    if with_images:
        for n in (1, 2):
            prompt = proc.default_multimodal_prompt("What is shown?", num_images=n)
            media = {"image": [_image(s) for s in range(n)]}
            inputs.append({"prompt": prompt, "multi_modal_data": media})
    out = []
    for i, item in enumerate(inputs):
        ids, extra = proc(item, None)
        params = MultimodalParams(extra.get("multimodal_data", {})) if extra else None
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        out.append(LlmRequest(i + 1, ids, greedy, multimodal_params=params))
    return out


def run_to_completion(executor: Any, requests: list[LlmRequest]) -> None:
    """Enqueue `requests` and wait for each to finish; a request's error raises here."""
    for req in requests:
        executor.enqueue_request(req)
    finished = 0
    while finished < len(requests):
        resp = executor.responses.get(timeout=120)
        if resp.error is not None:
            raise RuntimeError(f"request {resp.request_id}: {resp.error}")
        finished += int(resp.finished)


def generate(config: EngineConfig, with_images: bool) -> list[list[int]]:
    proc = create_input_processor(config.checkpoint_dir)
    executor = create_py_executor(config, proc)
    try:
        requests = _requests(proc, with_images)
        run_to_completion(executor, requests)
        return [list(r.output_token_ids) for r in requests]
    finally:
        executor.shutdown()


def greedy_tp1_and_tp(
    mapping: Mapping,
    checkpoint_dir: str,
    with_images: bool,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """Rank 0: (TP=1 tokens, TP=N tokens); the others: how many steps their worker ran.
    `overrides`: more LlmArgs fields (e.g. quantization)."""
    config = engine_config(checkpoint_dir, **(overrides or {}))
    if mapping.rank != 0:
        return run_tp_worker(replace(config, mapping=mapping))
    reference = generate(config, with_images)
    return reference, generate(replace(config, mapping=mapping), with_images)


def agreed_kv_blocks(mapping: Mapping, checkpoint_dir: str, fits: list[int]) -> Any:
    """Rank r's free memory is faked to fit `fits[r]` KV blocks; every KV cache each rank
    allocates is recorded. Rank 0: (TP=1 tokens, TP=N tokens, its caches, what it alone
    fits); the others: (their caches, what they alone fit)."""
    from tensorrt_llm._torch.pyexecutor import kv_cache_creator, tp_worker
    from tensorrt_llm._torch.pyexecutor.kv_cache_creator import (
        KVCacheSpec,
        blocks_that_fit,
        kv_bytes_per_token,
    )

    config = engine_config(checkpoint_dir)
    spec = KVCacheSpec.from_text_config(config.text_config, config.kv_cache_dtype, mapping.tp_size)
    per_block = kv_bytes_per_token(spec) * config.tokens_per_block
    fraction = config.kv_cache_free_gpu_memory_fraction
    free = int(fits[mapping.rank] * per_block / fraction) + per_block // 2
    alone = blocks_that_fit(spec, free, config.tokens_per_block, fraction)

    def fake_free(device: Any) -> int:
        return free

    # A CPU device has no pool to measure: this makes both ranks size from "memory".
    kv_cache_creator.device_free_bytes = fake_free  # type: ignore[assignment]
    tp_worker.device_free_bytes = fake_free  # type: ignore[assignment]
    caches: list[int] = []
    make_manager = KVCacheSpec.make_manager

    def recording(self: KVCacheSpec, tpb: int, num_blocks: int, *args: Any, **kw: Any) -> Any:
        caches.append(num_blocks)
        return make_manager(self, tpb, num_blocks, *args, **kw)

    KVCacheSpec.make_manager = recording  # type: ignore[method-assign]
    if mapping.rank != 0:
        run_tp_worker(replace(config, mapping=mapping))
        return caches, alone
    reference = generate(config, with_images=False)
    caches.clear()  # the TP=1 engine's caches
    sharded = generate(replace(config, mapping=mapping), with_images=False)
    return reference, sharded, caches, alone
