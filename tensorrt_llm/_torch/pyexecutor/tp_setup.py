"""What a tensor-parallel engine checks and sets up on rank 0 (`create_py_executor`'s hook).

Block reuse needs nothing here: a worker's KV blocks hold its heads of the same tokens, since
it runs every step rank 0 runs, into the blocks rank 0's tables name.

Sizes every rank must share are agreed here: the KV block count is the minimum over the
ranks of what each one's free memory fits (`agree_num_blocks`), so no rank allocates more than
it has, nor runs out before rank 0's scheduler thinks the cache is full.

The parts not built yet for `tensor_parallel_size > 1` are refused here by name, before any
model is built, rather than run wrong or slow.
"""

from __future__ import annotations

import logging

import torch

from ..models.modeling_auto import get_model_class
from ..models.modeling_utils import ModelConfig
from ..modules.fp8_block_model import apply_fp8_block_config_
from .engine_config import EngineConfig
from .kv_cache_creator import check_blocks_fit
from .model_engine import PyTorchModelEngine
from .spec_decode.setup import prepare_mtp
from .tp_step_channel import StepChannel

logger = logging.getLogger(__name__)


def check_tp_config(config: EngineConfig) -> None:
    """A ValueError naming each setting that tensor parallelism does not support yet."""
    mapping = config.mapping
    if not mapping.has_tp:
        return
    refused = []
    if config.use_cuda_graph:
        refused.append("CUDA graphs (pass cuda_graph_config=None)")
    # Quantization needs nothing here: block-FP8 shards whole 128-blocks with their scales
    # (fp8_block_linear.shard_block_scales); per-channel fp8 all-reduces a row-parallel
    # layer's row amax before quantizing (linear.quantize_model_fp8_), so every rank's
    # scales are one GPU's.
    # NOTE: nothing is refused for the Gated DeltaNet (Qwen3.5 / Qwen3.6) stacks: their heads,
    # conv channels and states shard (gated_delta_net_weights.py); prefix caching replays rank
    # 0's snapshot copies on each rank (state_snapshot_pool.py); MTP speculation shards the
    # head and the workers run every forward of a speculative step (spec_decode/tp_spec.py).
    if refused:
        raise ValueError(
            f"tensor_parallel_size={mapping.tp_size} does not support yet: " + ", ".join(refused)
        )


def check_model_shards(config: EngineConfig) -> None:
    """Build rank 0's model on the meta device (no memory): a stack that does not shard yet,
    a head / channel count that does not split over the ranks, or a block-FP8 shard that is
    not whole scale blocks, raises here, before the other ranks are started
    (`executor/tp_ranks.py`)."""
    check_tp_config(config)
    if not config.mapping.has_tp:
        return
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(
            ModelConfig(
                pretrained_config=config.pretrained_config,
                torch_dtype=config.dtype,
                attn_backend=config.attn_backend,
                max_num_seq_slots=config.batch_size_cap,
                max_num_tokens=config.max_num_tokens,
                mapping=config.mapping,
            )
        )
        if config.speculative_config is not None:  # its head shards as the stack does
            prepare_mtp(model, config.attn_backend)
        if config.quant_config is not None:  # block-FP8 shards must split whole blocks
            apply_fp8_block_config_(model, config.quant_config)


def attach_step_channel(engine: PyTorchModelEngine, config: EngineConfig) -> None:
    """Rank 0 of a tensor-parallel engine: send every step to the workers (no-op on one
    GPU). The workers must be running `tp_worker.run_tp_worker` with the same config."""
    mapping = config.mapping
    if not mapping.has_tp:
        return
    if not mapping.is_first_rank:
        raise ValueError(
            f"rank {mapping.rank} builds a worker (tp_worker.run_tp_worker), not an executor"
        )
    engine.step_channel = StepChannel(mapping, config.device)


def agree_num_blocks(
    engine: PyTorchModelEngine,
    num_blocks: int,
    reserved_bytes: int,
    seq_len_capped_after: bool,
) -> int:
    """Rank 0: `num_blocks` (what its own memory fits) lowered to the least any worker's
    memory fits; the batch size and max_seq_len are then derived from the agreed count on
    rank 0 alone and reach the workers with the cache (`KvCacheCommand`). As is on one GPU."""
    channel = engine.step_channel
    if channel is None:
        return num_blocks
    agreed = channel.send_kv_budget(num_blocks, reserved_bytes)
    if agreed < num_blocks:
        logger.info(
            "KV cache: %d blocks (rank 0's memory fits %d; a tensor-parallel rank has less)",
            agreed,
            num_blocks,
        )
    check_blocks_fit(
        agreed, engine.max_blocks_per_seq, seq_len_capped_after, " on a tensor-parallel rank"
    )
    return agreed
