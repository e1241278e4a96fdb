"""Rank bodies of the hybrid prefix-caching tests at TP=2: rank 0 runs a chat (a prompt, the
same prompt again, then the next turn) through a real executor, the worker replays the
step's snapshot copies; each side records the copies it sent or applied."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tp_engine_bodies import engine_config

from tensorrt_llm._torch.pyexecutor import tp_worker
from tensorrt_llm._torch.pyexecutor.engine_config import EngineConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.state_snapshot_pool import RecurrentSnapshotPool
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.llmapi import KvCacheConfig
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.sampling_params import SamplingParams

TPB = 4
MAX_TOKENS = 6
TEXT = "the quick brown fox jumps over the lazy dog and keeps on running far away"
NEXT_QUESTION = [5, 6, 7]
# The snapshot entries the worker's memory "fits" (rank 0's fits thousands): all ranks must
# build this many, and it still holds this chat's snapshots.
WORKER_ENTRIES = 8

Copy = tuple[int, int, int]


def reuse_config(checkpoint_dir: str, reuse: bool) -> EngineConfig:
    return engine_config(
        checkpoint_dir,
        tokens_per_block=TPB,
        kv_cache_config=KvCacheConfig(enable_block_reuse=reuse),
    )


def _run_one(executor: Any, req: LlmRequest) -> tuple[list[int], int]:
    """One request alone (the next is admitted only after it finished: its snapshots and
    cached blocks are then there to hit)."""
    executor.enqueue_request(req)
    while True:
        resp = executor.responses.get(timeout=120)
        if resp.error is not None:
            raise RuntimeError(f"request {resp.request_id}: {resp.error}")
        if resp.finished:
            return list(req.output_token_ids), req.num_cached_tokens


def chat(config: EngineConfig) -> list[tuple[list[int], int]]:
    """(greedy tokens, cached prompt tokens) of: a prompt, the same again, the next turn."""
    proc = create_input_processor(config.checkpoint_dir)
    executor = create_py_executor(config, proc)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def request(request_id: int, item: dict[str, Any]) -> LlmRequest:
        # Through the processor: an mRoPE model's request carries its position ids.
        ids, extra = proc(item, None)
        params = MultimodalParams(extra.get("multimodal_data", {})) if extra else None
        return LlmRequest(request_id, ids, greedy, multimodal_params=params)

    try:
        first = _run_one(executor, request(1, {"prompt": TEXT}))
        again = _run_one(executor, request(2, {"prompt": TEXT}))
        history = list(proc({"prompt": TEXT}, None)[0]) + first[0] + NEXT_QUESTION
        turn2 = _run_one(executor, request(3, {"prompt_token_ids": history}))
        return [first, again, turn2]
    finally:
        executor.shutdown()


def _record(method: str, into: list[Copy], capacities: set[int]) -> None:
    """Wrap `RecurrentSnapshotPool.<method>` (this rank's process only) to keep its copies
    and the capacity of the pool that made them."""
    original = getattr(RecurrentSnapshotPool, method)

    def recording(self: RecurrentSnapshotPool, *args: Any) -> Any:
        result = original(self, *args)
        into.extend(result if method == "take_copies" else args[0])
        capacities.add(self.capacity)
        return result

    setattr(RecurrentSnapshotPool, method, recording)


def chat_tp1_and_tp(mapping: Mapping, checkpoint_dir: str) -> Any:
    """Rank 0: (TP=1 reuse-off chat, TP=N reuse-on chat, the copies sent, pool capacities);
    the workers: (steps run, the copies applied, pool capacities). A worker's memory fits
    `WORKER_ENTRIES` snapshots only."""
    config = replace(reuse_config(checkpoint_dir, True), mapping=mapping)
    copies: list[Copy] = []
    capacities: set[int] = set()
    if mapping.rank != 0:
        pool_bytes = tp_worker.snapshot_pool_bytes(config, config.device, 0, 0)
        tp_worker.snapshot_bytes = lambda state: pool_bytes // WORKER_ENTRIES  # type: ignore
        _record("apply_copies", copies, capacities)
        return tp_worker.run_tp_worker(config), copies, capacities
    reference = chat(reuse_config(checkpoint_dir, False))
    _record("take_copies", copies, capacities)
    return reference, chat(config), copies, capacities
