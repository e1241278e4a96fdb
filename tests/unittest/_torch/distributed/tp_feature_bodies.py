"""Rank bodies of the tensor-parallel feature tests (prompt logprobs, the vision embedding
cache): rank 0 runs a real executor, the others the worker loop (`tp_engine_bodies.py`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from tp_bodies import NUM_DECODE, PROMPTS, _manager, chunked_schedule, run_schedule, text_lm
from tp_engine_bodies import engine_config, run_to_completion

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.modules.linear import Linear, quantize_model_fp8_
from tensorrt_llm._torch.pyexecutor import prompt_logprobs as plp
from tensorrt_llm._torch.pyexecutor.engine_config import EngineConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.tp_worker import run_tp_worker
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.inputs.media_hash import (
    MULTIMODAL_HASHES,
    MULTIMODAL_SOURCES,
    hash_multimodal_data,
)
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.sampling_params import SamplingParams

PROMPT_LOGPROB_PROMPTS = ["the quick brown fox jumps over the lazy dog, again", "a b c d"]


def _run_requests(config: EngineConfig, requests: list[LlmRequest]) -> None:
    executor = create_py_executor(config, create_input_processor(config.checkpoint_dir))
    try:
        run_to_completion(executor, requests)
    finally:
        executor.shutdown()


def _prompt_logprobs(config: EngineConfig) -> list[dict[str, Any]]:
    proc = create_input_processor(config.checkpoint_dir)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    requests = [
        LlmRequest(i + 1, proc({"prompt": p}, None)[0], params)
        for i, p in enumerate(PROMPT_LOGPROB_PROMPTS)
    ]
    _run_requests(config, requests)
    return [{"tokens": list(r.output_token_ids), "prompt": r.prompt_logprobs} for r in requests]


def prompt_logprobs_tp1_and_tp(mapping: Mapping, checkpoint_dir: str, slice_rows: int) -> Any:
    """Rank 0: (TP=1 entries, TP=N entries) per request, the LM head run over `slice_rows`
    prompt rows at a time on every rank; the others: how many steps their worker ran."""
    config = engine_config(checkpoint_dir)
    plp.SLICE_BYTES = 4 * config.text_config.vocab_size * slice_rows
    if mapping.rank != 0:
        return run_tp_worker(replace(config, mapping=mapping))
    return _prompt_logprobs(config), _prompt_logprobs(replace(config, mapping=mapping))


def _fp8_linears(cls: type, model_config: ModelConfig, device: torch.device) -> dict[str, Any]:
    """name -> (16-bit weight, e4m3 weight as float32, weight_scale) of every Linear that
    `quantize_model_fp8_` converts, after loading `model_config`'s shard (on the CPU)."""
    model = load_model(cls, model_config, device)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    before = {n: m.weight.detach().cpu().clone() for n, m in linears.items()}
    quantize_model_fp8_(model)
    return {
        n: (before[n], m.weight.float().cpu(), m.weight_scale.cpu().clone())
        for n, m in linears.items()
        if m.per_channel_fp8
    }


def fp8_per_channel_layers(
    mapping: Mapping, checkpoint_dir: str, on_gpu: bool = False
) -> dict[str, Any]:
    """Every per-channel FP8 Linear of the checkpoint at TP=1 and at this rank's TP=N (with
    `on_gpu`, built on this rank's GPU: the amax all-reduce runs over NCCL)."""
    device = torch.device("cuda", mapping.local_rank) if on_gpu else torch.device("cpu")
    config = load_pretrained_config(checkpoint_dir)
    cls = get_model_class(config.tllm_architecture)
    base = ModelConfig(pretrained_config=config, checkpoint_dir=checkpoint_dir)
    return {
        "single": _fp8_linears(cls, base, device),
        "sharded": _fp8_linears(cls, replace(base, mapping=mapping), device),
    }


def fp8_schedule_logits(mapping: Mapping, checkpoint_dir: str) -> dict[str, Any]:
    """`tp_bodies.schedule_logits` of the model converted to per-channel FP8 at TP=1 and at
    TP=N, plus the 16-bit TP=1 model's ("plain": what both approximate)."""
    config = load_pretrained_config(checkpoint_dir)
    cls = get_model_class(config.tllm_architecture)
    base = ModelConfig(pretrained_config=config, checkpoint_dir=checkpoint_dir)
    device = torch.device("cpu")
    models = []
    for model_config, fp8 in ((base, False), (base, True), (replace(base, mapping=mapping), True)):
        model = load_model(cls, model_config, device)
        if fp8:
            quantize_model_fp8_(model)
        models.append(text_lm(model))
    gen = torch.Generator().manual_seed(5)
    vocab = int(models[0].config.vocab_size)
    sequences = [torch.randint(0, vocab, (n + NUM_DECODE + 1,), generator=gen) for n in PROMPTS]
    schedule = chunked_schedule(PROMPTS, chunked=2, num_decode=NUM_DECODE)
    plain, reference, sharded = (
        run_schedule(lm, _manager(lm, device), sequences, schedule) for lm in models
    )
    return {"plain": plain, "reference": reference, "sharded": sharded}


# The vision embedding cache test: images by seed, sent one request at a time (each after the
# previous one finished), so the second sight of an image finds it cached.
VISION_REQUESTS = [[0, 1], [1, 0], [2, 0], [1]]


def _watch_vision(encoded: list[int], caches: list[Any]) -> None:
    """Record the items each tower call encodes once a cache exists (not the capacity
    probe's), and every cache built in this process."""
    from tensorrt_llm._torch.models import vision_embedding_cache as vec
    from tensorrt_llm._torch.models.modeling_qwen_vl_base import QwenVLModelBase

    whole = QwenVLModelBase._run_tower_whole
    init = vec.VisionEmbeddingCache.__init__

    def counting(self: Any, pixels: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        if self.vision_embedding_cache is not None:
            encoded.append(int(grid_thw.reshape(-1, 3).shape[0]))
        return whole(self, pixels, grid_thw)

    def recording(self: Any, capacity_bytes: int) -> None:
        init(self, capacity_bytes)
        caches.append(self)

    QwenVLModelBase._run_tower_whole = counting  # type: ignore[method-assign]
    vec.VisionEmbeddingCache.__init__ = recording  # type: ignore[method-assign]


def _cache_state(cache: Any) -> dict[str, Any]:
    return {
        "capacity": cache.capacity_bytes,
        "hits": cache.hits,
        "misses": cache.misses,
        "evictions": cache.evictions,
        "keys": [key.hex() for key in cache._entries],  # LRU order, oldest first
    }


def _vision_requests(config: EngineConfig) -> list[list[int]]:
    from tp_engine_bodies import _image

    proc = create_input_processor(config.checkpoint_dir)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    executor = create_py_executor(config, proc)
    tokens = []
    try:
        for i, seeds in enumerate(VISION_REQUESTS):
            prompt = proc.default_multimodal_prompt("What is shown?", num_images=len(seeds))
            media = {"image": [_image(s) for s in seeds]}
            ids, extra = proc({"prompt": prompt, "multi_modal_data": media}, None)
            data = extra["multimodal_data"]
            # The content hashes the LLM API's input preparer adds (the cache's keys).
            data[MULTIMODAL_HASHES] = hash_multimodal_data(
                data, {}, extra.pop(MULTIMODAL_SOURCES, None)
            )
            params = MultimodalParams(data)
            req = LlmRequest(i + 1, ids, greedy, multimodal_params=params)
            executor.enqueue_request(req)
            while not (resp := executor.responses.get(timeout=120)).finished:
                if resp.error is not None:
                    raise RuntimeError(f"request {resp.request_id}: {resp.error}")
            tokens.append(list(req.output_token_ids))
    finally:
        executor.shutdown()
    return tokens


def vision_cache_tp1_and_tp(mapping: Mapping, checkpoint_dir: str, capacity: int) -> Any:
    """`VISION_REQUESTS` with a `capacity`-byte vision embedding cache. Rank 0: TP=1 then
    TP=N, each {tokens, items per tower call, its cache's state}; the others: {items per
    tower call, their cache's state} of the TP=N run."""
    encoded: list[int] = []
    caches: list[Any] = []
    _watch_vision(encoded, caches)
    config = replace(engine_config(checkpoint_dir), vision_embedding_cache_bytes=capacity)
    if mapping.rank != 0:
        run_tp_worker(replace(config, mapping=mapping))
        return {"tower": encoded, "cache": _cache_state(caches[-1]), "caches": len(caches)}
    runs = []
    for run_config in (config, replace(config, mapping=mapping)):
        encoded.clear()
        tokens = _vision_requests(run_config)
        runs.append({"tokens": tokens, "tower": list(encoded), "cache": _cache_state(caches[-1])})
    return runs


def items_check(mapping: Mapping, tokens_per_rank: list[list[int]]) -> str:
    """`check_same_items` with this rank's planned items; the error it raised, or ""."""
    from tensorrt_llm._torch.models.vision_data_parallel import check_same_items

    try:
        check_same_items("image", tokens_per_rank[mapping.rank], mapping, torch.device("cpu"))
    except RuntimeError as exc:
        return str(exc)
    return ""
