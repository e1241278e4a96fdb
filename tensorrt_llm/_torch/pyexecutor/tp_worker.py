"""A worker rank of a tensor-parallel engine: its shard of the model, no scheduler.

`run_tp_worker(config)` builds the same engine as rank 0 does (`create_py_executor`), from the
same `EngineConfig` with this rank's `mapping`, then runs every step rank 0 broadcasts
(`tp_step_channel.py`) until rank 0 says stop. Rank 0 samples; a worker's logits are dropped
(the LM head all-gathers the vocabulary, so every rank holds the same ones).

A worker sizes nothing alone: its KV cache has the block count rank 0 sends, which is the
minimum over the ranks of what each one's free memory fits (`KvBudgetCommand`), measured as
rank 0 measures its own, after the same capacity probe.

Hybrid prefix caching: the worker's recurrent snapshot pool has the entry count all ranks
agreed (`SnapshotPoolCommand`, built before the KV sizing as on rank 0) and no bookkeeping
of its own: it replays the copies each step carries, by rank 0's entry indices, on this
rank's shard of the state, before the step's forward.

MTP speculative decoding: rank 0 sends each forward of a speculative step (target, draft
passes, replay) as a `SpecCommand` followed by its batch; `SpecWorker` runs them on this
rank's shards (spec_decode/tp_spec.py).

The vision embedding cache: built when rank 0 builds its own (`VisionCacheCommand`, after the
capacity probe), of the same capacity. The tower is data-parallel, so every rank must skip the
same cached items and split only the misses: each rank's cache sees the same lookups and puts
(the same steps, media hashes and entry sizes, every rank holding every item's embeddings after
the all-gather), so its hits and LRU evictions are rank 0's.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, cast

import torch

from ..models.modeling_auto import get_model_class
from ..models.vision_embedding_cache import VisionEmbeddingCache
from .engine_config import EngineConfig
from .hybrid_kv_cache_reuse import (
    recurrent_slot_state,
    snapshot_pool_bytes,
    snapshot_scratch_slots,
)
from .kv_cache_creator import KVCacheSpec, blocks_that_fit, device_free_bytes
from .model_build import build_model, engine_max_seq_len, sized_model_config
from .model_engine import PyTorchModelEngine
from .spec_decode.setup import kv_spec_with_mtp, text_lm
from .spec_decode.tp_spec import SpecCommand, SpecWorker
from .state_snapshot_pool import RecurrentSnapshotPool, snapshot_bytes
from .tp_setup import check_tp_config
from .tp_step_channel import (
    KvBudgetCommand,
    KvCacheCommand,
    SnapshotPoolCommand,
    StepChannel,
    VisionCacheCommand,
)

logger = logging.getLogger(__name__)


def build_engine_shard(config: EngineConfig) -> tuple[PyTorchModelEngine, KVCacheSpec]:
    """This rank's model shard in an engine sized as rank 0's (the same config fields)."""
    spec = kv_spec_with_mtp(  # the layers rank 0's cache has (create_py_executor)
        KVCacheSpec.from_text_config(
            config.text_config, config.kv_cache_dtype, config.mapping.tp_size
        ),
        config,
    )
    cls = get_model_class(config.architecture)
    # A hybrid stack on CUDA without max_batch_size: the slot count all ranks agreed (MIN).
    model_config, _presized = sized_model_config(config, cls, spec)
    model = build_model(cls, model_config, config.device, config)
    engine = PyTorchModelEngine(
        model,
        config.device,
        max_num_tokens=config.max_num_tokens,
        max_batch_size=model_config.max_num_seq_slots,
        max_seq_len=engine_max_seq_len(config, spec),
        tokens_per_block=config.tokens_per_block,
    )
    return engine, spec


def worker_num_blocks(config: EngineConfig, spec: KVCacheSpec, command: KvBudgetCommand) -> int:
    """The KV blocks this rank's free memory fits (at most rank 0's proposal), sized as
    `choose_num_blocks` does on rank 0: the fraction of what the probe's activation peak and
    rank 0's reservations leave. Rank 0 checks the agreed count, so nothing raises here (a
    worker that raised would leave rank 0 waiting in the collective)."""
    device = config.device
    free = device_free_bytes(device)
    if free is None:  # no device pool (CPU): rank 0's full-batch count
        return command.proposed_blocks
    activation = 0
    if device.type == "cuda":  # the peak since the probe's cache was set (run_tp_worker)
        activation = max(
            0, torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        )
    own = blocks_that_fit(
        spec,
        free,
        config.tokens_per_block,
        config.kv_cache_free_gpu_memory_fraction,
        activation + command.reserved_bytes,
    )
    return min(own, command.proposed_blocks)


def worker_snapshot_pool(
    config: EngineConfig, engine: PyTorchModelEngine, channel: StepChannel, proposed: int
) -> RecurrentSnapshotPool:
    """This rank's snapshot pool: as many entries as every rank fits (the agreed minimum)."""
    state = recurrent_slot_state(engine.slot_state.model_state)
    per_entry = snapshot_bytes(state) if state else 0
    batch_slots = engine.max_batch_size - snapshot_scratch_slots(config)
    max_bytes = snapshot_pool_bytes(config, config.device, per_entry, batch_slots)
    own = max_bytes // per_entry if per_entry else 0
    agreed = channel.agree_min(min(own, proposed))
    # Raises as rank 0's does when the agreed count is 0 (both ranks fail, none waits).
    return RecurrentSnapshotPool(state, max_bytes, agreed)


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
    snapshots: RecurrentSnapshotPool | None = None
    speculative = (
        SpecWorker(engine, channel, text_lm(engine.model))
        if config.speculative_config is not None
        else None
    )
    while True:
        command = channel.receive()
        if command is None:
            logger.info("tp worker rank %d: stop after %d steps", mapping.rank, steps)
            return steps
        if isinstance(command, KvBudgetCommand):
            channel.agree_min(worker_num_blocks(config, spec, command))
            continue
        if isinstance(command, SnapshotPoolCommand):
            snapshots = worker_snapshot_pool(config, engine, channel, command.proposed_entries)
            continue
        if isinstance(command, SpecCommand):
            if speculative is None:
                raise RuntimeError("rank 0 sent a speculative step to a worker without MTP")
            speculative.handle(command)
            steps += 1
            continue
        if isinstance(command, VisionCacheCommand):
            cast(Any, engine.model).vision_embedding_cache = VisionEmbeddingCache(
                command.capacity_bytes
            )
            continue
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
            if kv is not None and config.device.type == "cuda":
                # Rank 0 measures the probe's activation peak from the same point.
                torch.cuda.reset_peak_memory_stats(config.device)
            continue
        if engine.kv_cache_manager is None:
            raise RuntimeError("rank 0 sent a step before any KV cache")
        batch = replace(
            command,
            attn_metadata=replace(command.attn_metadata, kv_cache_manager=engine.kv_cache_manager),
        )
        with torch.inference_mode():
            if channel.snapshot_copies:
                if snapshots is None:
                    raise RuntimeError("rank 0 sent snapshot copies before a snapshot pool")
                snapshots.apply_copies(channel.snapshot_copies)
            # run_step: a step with prompt logprobs runs the hidden-state forward and the
            # LM-head slices rank 0 runs (`run` otherwise), so the collectives match.
            engine.run_step(batch)
        steps += 1
