"""Rank bodies of the tensor-parallel feature tests (prompt logprobs, the vision embedding
cache): rank 0 runs a real executor, the others the worker loop (`tp_engine_bodies.py`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tp_engine_bodies import engine_config

from tensorrt_llm._torch.pyexecutor import prompt_logprobs as plp
from tensorrt_llm._torch.pyexecutor.engine_config import EngineConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.tp_worker import run_tp_worker
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
