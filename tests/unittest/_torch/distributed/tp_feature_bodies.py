"""Rank bodies of the tensor-parallel feature tests (prompt logprobs, the vision embedding
cache): rank 0 runs a real executor, the others the worker loop (`tp_engine_bodies.py`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from tp_bodies import NUM_DECODE, PROMPTS, _manager, chunked_schedule, run_schedule, text_lm
from tp_engine_bodies import engine_config

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
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.sampling_params import SamplingParams

PROMPT_LOGPROB_PROMPTS = ["the quick brown fox jumps over the lazy dog, again", "a b c d"]


def _run_requests(config: EngineConfig, requests: list[LlmRequest]) -> None:
    executor = create_py_executor(config, create_input_processor(config.checkpoint_dir))
    try:
        for req in requests:
            executor.enqueue_request(req)
        finished = 0
        while finished < len(requests):
            resp = executor.responses.get(timeout=120)
            if resp.error is not None:
                raise RuntimeError(f"request {resp.request_id}: {resp.error}")
            finished += int(resp.finished)
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


def _fp8_linears(cls: type, model_config: ModelConfig) -> dict[str, Any]:
    """name -> (16-bit weight, e4m3 weight as float32, weight_scale) of every Linear that
    `quantize_model_fp8_` converts, after loading `model_config`'s shard."""
    model = load_model(cls, model_config, "cpu")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    before = {n: m.weight.detach().clone() for n, m in linears.items()}
    quantize_model_fp8_(model)
    return {
        n: (before[n], m.weight.float(), m.weight_scale.clone())
        for n, m in linears.items()
        if m.per_channel_fp8
    }


def fp8_per_channel_layers(mapping: Mapping, checkpoint_dir: str) -> dict[str, Any]:
    """Every per-channel FP8 Linear of the checkpoint at TP=1 and at this rank's TP=N."""
    config = load_pretrained_config(checkpoint_dir)
    cls = get_model_class(config.tllm_architecture)
    base = ModelConfig(pretrained_config=config, checkpoint_dir=checkpoint_dir)
    return {
        "single": _fp8_linears(cls, base),
        "sharded": _fp8_linears(cls, replace(base, mapping=mapping)),
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
