"""Building an engine's model from its `EngineConfig`: the model config, meta init and weights
(or random ones at real size), and the max_seq_len the engine's tables are sized for. Shared by
`create_py_executor` (rank 0) and the tensor-parallel worker ranks (`tp_worker.py`)."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ...mapping import Mapping as ParallelMapping
from ..distributed import min_over_ranks
from ..models.modeling_utils import ModelConfig
from ..modules.fp8_block_model import (
    apply_fp8_block_config_,
    fill_dummy_fp8_block_,
    quantize_moe_experts_fp8_block_,
)
from ..modules.fp8_linear import quantize_linear_fp8_
from ..modules.fused_moe import MoEExperts, fuse_shared_experts_
from ..modules.gated_delta_net import fuse_gdn_in_projections_
from ..modules.linear import per_channel_fp8_linears, quantize_model_fp8_
from ..weight_loading import build_model_on_meta, load_model
from .capacity import (
    BatchSizing,
    estimate_weight_bytes,
    recurrent_state_bytes_per_slot,
    size_hybrid_slots,
    typical_request_tokens,
)
from .engine_config import MAX_SEQ_LEN_USER, EngineConfig
from .hybrid_kv_cache_reuse import snapshot_scratch_slots
from .kv_cache_creator import KVCacheSpec, kv_bytes_per_token, kv_tokens_upper_bound
from .spec_decode.setup import prepare_mtp

logger = logging.getLogger(__name__)


def fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights at real sizes (benchmarks): small normal matrices, unit norms, zero biases.

    Generated where the parameter lives: host-side generation of billions of values is slow.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.dtype == torch.float8_e4m3fn or name.endswith("weight_scale_inv"):
            continue  # block-FP8 layers: fill_dummy_fp8_block_
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)


def model_config_of(config: EngineConfig) -> ModelConfig:
    """The model's build config from the engine's (every rank builds from the same one)."""
    return ModelConfig(
        pretrained_config=config.pretrained_config,
        torch_dtype=config.dtype,
        attn_backend=config.attn_backend,
        max_num_seq_slots=config.batch_size_cap,
        max_num_tokens=config.max_num_tokens,
        checkpoint_dir=config.checkpoint_dir,
        mapping=config.mapping,
        ssm_state_dtype=config.ssm_state_dtype,
    )


def sized_model_config(
    config: EngineConfig, cls: type, spec: KVCacheSpec
) -> tuple[ModelConfig, BatchSizing | None]:
    """The model config with its seq-slot rows (the hybrid presizing when there is one, plus
    the inner-snapshot scratch slots: `snapshot_scratch_slots`) and the presizing. NOTE: a
    collective under tensor parallelism (`presize_hybrid`): every rank calls it alike."""
    model_config = model_config_of(config)
    presized = presize_hybrid(config, cls, model_config, spec)
    slots = model_config.max_num_seq_slots if presized is None else presized.max_batch_size
    slots += snapshot_scratch_slots(config)
    return replace(model_config, max_num_seq_slots=slots), presized


def build_model(
    cls: type,
    model_config: ModelConfig,
    device: torch.device,
    config: EngineConfig,
) -> torch.nn.Module:
    """The model with its weights (the checkpoint's, or random at real size for "dummy"),
    its block-FP8 layers switched on meta first, per-channel FP8 (`quantization="fp8"`)
    converted last, eval mode. NOTE: under tensor parallelism the fp8 conversion is a
    collective per row-parallel layer (`quantize_model_fp8_`): every rank builds here."""
    quant = config.quant_config

    def prepare(model: torch.nn.Module) -> None:  # on meta: no 16-bit copy of FP8 layers
        converted = _prepare_on_meta(model, config)
        if quant is not None:
            source = "checkpoint" if quant.from_checkpoint else "quantized at load"
            logger.info("fp8_block: %d block-FP8 linear layers (%s)", converted, source)

    if config.load_format == "dummy":
        model = build_model_on_meta(cls, model_config, device, prepare)
        fill_dummy_weights(model, config.seed)
        if quant is not None:
            fill_dummy_fp8_block_(model, config.seed)
    else:
        model = load_model(cls, model_config, device, prepare=prepare)
    if _experts_quantized_after_load(config):
        quantize_moe_experts_fp8_block_(model)
    # After the experts' final precision: random weights, or experts converted to FP8 after
    # loading, fuse only now (a checkpoint's load_weights fused already where it could).
    fuse_shared_experts_(model)
    if config.quantization == "fp8":
        converted = quantize_model_fp8_(model)
        logger.info("fp8: quantised %d linear layers of the text decoder", converted)
    # Last, with every weight final (loaded, quantized): each DeltaNet layer's two input
    # projections become one GEMM; the forward only reads the joined weight.
    fuse_gdn_in_projections_(model)
    return model.eval()


def _prepare_on_meta(model: torch.nn.Module, config: EngineConfig) -> int:
    """What the build does on the meta model: the MTP head, the block-FP8 linears (how many)."""
    if config.speculative_config is not None:
        prepare_mtp(model, config.attn_backend)
    if config.quant_config is None:
        return 0
    return apply_fp8_block_config_(model, config.quant_config)


def _experts_quantized_after_load(config: EngineConfig) -> bool:
    """Whether `build_model` converts 16-bit routed experts to block FP8 after loading (random
    weights, or a 16-bit checkpoint with quantization="fp8_block")."""
    quant = config.quant_config
    return quant is not None and (config.load_format == "dummy" or not quant.from_checkpoint)


def served_weight_bytes(config: EngineConfig, cls: type, model_config: ModelConfig) -> int:
    """The bytes `build_model`'s parameters end up with, from a build on the meta device given
    their final precision there: block-FP8 linears and experts, per-channel FP8 linears, the
    MTP head. (The 16-bit build dtype over-counts an FP8 model twice: the hybrid presizing
    then gave Qwen3.6-35B-A3B-FP8 on an 80 GB card a fraction of the slots it fits.)"""
    quant = config.quant_config

    def prepare(model: torch.nn.Module) -> None:
        _prepare_on_meta(model, config)
        # Routed experts end block-FP8 whenever a block-FP8 config is set: converted after
        # loading 16-bit or random weights, or loaded so from a checkpoint that carries their
        # scales (`prepare_fp8_block_experts_`; the releases quantize every expert).
        if quant is not None:
            for module in model.modules():
                if isinstance(module, MoEExperts) and module.weight_block_size is None:
                    module.use_fp8_block_(quant.weight_block_size)
        if config.quantization == "fp8":
            for _, linear in per_channel_fp8_linears(model):
                quantize_linear_fp8_(linear)  # shapes only: meta tensors

    return estimate_weight_bytes(cls, model_config, prepare)


def engine_max_seq_len(config: EngineConfig, spec: KVCacheSpec) -> int:
    """The max_seq_len the engine's block tables are sized for: a default one bounded by the
    most tokens the KV cache could hold (a 262144-token max_position_embeddings must not size
    tables for tokens that cannot fit); the user's as given."""
    if config.max_seq_len_source == MAX_SEQ_LEN_USER:
        return config.max_seq_len
    bound = kv_tokens_upper_bound(
        spec, config.device, config.kv_cache_free_gpu_memory_fraction, config.kv_cache_max_tokens
    )
    if config.mapping.has_tp:
        # Each rank measured its own memory: every rank's tables get the least one's width.
        # NOTE: a collective; rank 0 (create_py_executor) and the workers (tp_worker.py) call
        # this at the same point of their startup, after building the model.
        own = config.max_seq_len if bound is None else bound
        bound = min_over_ranks([own], config.mapping, config.device)[0]
    if bound is None:
        return config.max_seq_len
    return max(config.tokens_per_block, min(config.max_seq_len, bound))


def presize_hybrid(
    config: EngineConfig, cls: type, model_config: ModelConfig, spec: KVCacheSpec
) -> BatchSizing | None:
    """Seq slots of a hybrid model on CUDA when max_batch_size is not given (see capacity.py);
    None for every other case. Under tensor parallelism every rank sizes from its own free
    memory and they agree the least (MIN), so no rank builds more recurrent state than it fits.
    NOTE: a collective; rank 0 (create_py_executor) and the workers (tp_worker.py) call this
    at the same point of their startup, before building the model (the conditions are the
    config's, the same on every rank)."""
    state = recurrent_state_bytes_per_slot(
        config.text_config, model_config.torch_dtype, config.mapping.tp_size,
        config.ssm_state_dtype,
    )  # fmt: skip
    if config.max_batch_size is not None or config.device.type != "cuda" or not state:
        return None
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(config.device)
    probe_config = replace(model_config, max_num_seq_slots=1)
    sizing = size_hybrid_slots(
        model_config.max_num_seq_slots,
        free,
        served_weight_bytes(config, cls, probe_config),
        config.kv_cache_free_gpu_memory_fraction,
        state,
        kv_bytes_per_token(spec),
        typical_request_tokens(config.max_seq_len),
    )
    return agree_hybrid_slots(sizing, config.mapping, config.device)


def agree_hybrid_slots(
    sizing: BatchSizing, mapping: ParallelMapping, device: torch.device
) -> BatchSizing:
    """The least slot count any tp rank's memory fits (this rank's sizing when it is that
    one); as is on one GPU. A collective (see `presize_hybrid`)."""
    if not mapping.has_tp:
        return sizing
    agreed = min_over_ranks([sizing.max_batch_size], mapping, device)[0]
    if agreed == sizing.max_batch_size:
        return sizing
    detail = f"a tensor-parallel rank fits fewer; this rank: {sizing.describe()}"
    return BatchSizing(agreed, "recurrent state", detail)
