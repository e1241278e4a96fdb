"""A worker rank of a tensor-parallel engine: its shard of the model, no scheduler.

`run_tp_worker(config)` builds the same engine as rank 0 does (`create_py_executor`), from the
same `EngineConfig` with this rank's `mapping`, then runs every step rank 0 broadcasts
(`tp_step_channel.py`) until rank 0 says stop. Rank 0 samples; a worker's logits are dropped
(the LM head all-gathers the vocabulary, so every rank holds the same ones).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..models.modeling_auto import get_model_class
from .engine_config import EngineConfig
from .kv_cache_creator import KVCacheSpec
from .model_build import build_model, engine_max_seq_len, model_config_of
from .model_engine import PyTorchModelEngine
from .tp_setup import check_tp_config
from .tp_step_channel import KvCacheCommand, StepChannel

logger = logging.getLogger(__name__)


def build_engine_shard(config: EngineConfig) -> tuple[PyTorchModelEngine, KVCacheSpec]:
    """This rank's model shard in an engine sized as rank 0's (the same config fields)."""
    spec = KVCacheSpec.from_text_config(
        config.text_config, config.kv_cache_dtype, config.mapping.tp_size
    )
    cls = get_model_class(config.architecture)
    model = build_model(cls, model_config_of(config), config.device, config)
    engine = PyTorchModelEngine(
        model,
        config.device,
        max_num_tokens=config.max_num_tokens,
        max_batch_size=config.batch_size_cap,
        max_seq_len=engine_max_seq_len(config, spec),
        tokens_per_block=config.tokens_per_block,
    )
    return engine, spec


def run_tp_worker(config: EngineConfig) -> int:
    """Serve rank 0's steps until it stops; returns how many steps ran."""
    mapping = config.mapping
    if mapping.is_first_rank or not mapping.has_tp:
        raise ValueError(f"run_tp_worker is for ranks 1.. of a tp group, got {mapping}")
    check_tp_config(config)
    engine, spec = build_engine_shard(config)
    channel = StepChannel(mapping, config.device)
    logger.info("tp worker rank %d/%d ready", mapping.rank, mapping.world_size)
    steps = 0
    while True:
        command = channel.receive()
        if command is None:
            logger.info("tp worker rank %d: stop after %d steps", mapping.rank, steps)
            return steps
        if isinstance(command, KvCacheCommand):
            kv = None
            if command.num_blocks:
                kv = spec.make_manager(
                    config.tokens_per_block,
                    command.num_blocks,
                    command.max_blocks_per_seq,
                    config.device,
                )
            engine.set_kv_cache_manager(kv)
            continue
        if engine.kv_cache_manager is None:
            raise RuntimeError("rank 0 sent a step before any KV cache")
        batch = replace(
            command,
            attn_metadata=replace(command.attn_metadata, kv_cache_manager=engine.kv_cache_manager),
        )
        with torch.inference_mode():
            engine.run(batch)
        steps += 1
