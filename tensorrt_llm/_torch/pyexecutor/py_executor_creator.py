"""create_py_executor: a resolved EngineConfig -> a running PyExecutor.

Order matters: build the model (meta init, then weights), capture the piecewise graphs, run the
capacity probe with a text-only and a multimodal dummy request, size the KV cache from what is
left, capture the decode graphs, warm every step shape up (CUDA, `warmup.py`), then start the
loop. Every knob comes from the frozen `EngineConfig` (`LlmArgs.to_engine_config()`): nothing
here reads or resolves user arguments.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from ...inputs.multimodal import MultimodalParams
from ..config_utils import is_hybrid_model
from ..models.modeling_auto import get_model_class
from ..models.vision_embedding_cache import VisionEmbeddingCache
from ..quantization import QuantConfig
from .capacity import (
    BatchSizing,
    SeqLenSizing,
    cap_max_seq_len,
    size_from_kv,
    typical_request_tokens,
)
from .cuda_graph_runner import CUDAGraphRunner, graph_batch_sizes
from .engine_config import MAX_SEQ_LEN_USER, CudaGraphConfig, EngineConfig
from .guided_decoder import GuidedDecoder
from .hybrid_kv_cache_reuse import (
    make_kv_cache_reuse,
    make_snapshot_pool,
    snapshot_scratch_slots,
)
from .kv_cache_creator import (
    KVCacheSpec,
    choose_num_blocks,
    run_capacity_probe,
)
from .model_build import build_model, engine_max_seq_len, sized_model_config
from .model_engine import PyTorchModelEngine
from .piecewise_graph_runner import (
    DEFAULT_PIECEWISE_MAX_TOKENS,
    PiecewiseCUDAGraphRunner,
    piecewise_token_buckets,
    why_not_piecewise,
)
from .py_executor import PyExecutor
from .py_executor_overlap import OverlapPyExecutor
from .resource_manager import SeqSlotManager
from .sampler import TorchSampler
from .scheduler import SimpleScheduler
from .spec_decode.setup import (
    attach_spec_decoder,
    capture_verify_graphs,
    kv_spec_with_mtp,
    snapshot_reserve_bytes,
    verify_tokens_per_request,
)
from .spec_decode.spec_warmup import run_spec_warmup
from .tp_setup import agree_num_blocks, attach_step_channel, check_tp_config
from .warmup import StartupTuning, arm_step_compile_guard, run_warmup, warmup_enabled

logger = logging.getLogger(__name__)

# The text-only dummy is a full max_num_tokens prefill on GPU (that is what peaks memory);
# on the CPU there is no device pool to measure, so a short one proves the route works.
_CPU_TEXT_DUMMY_TOKENS = 32


def _dummy_requests(
    input_processor: Any, engine: PyTorchModelEngine, max_seq_len: int, has_vision: bool
) -> list[tuple[list[int], MultimodalParams | None]]:
    """(prompt ids, multimodal params) of the text-only and the multimodal dummy requests."""
    budget = min(engine.max_num_tokens, max_seq_len - 2)
    if engine.device.type != "cuda":
        budget = min(budget, _CPU_TEXT_DUMMY_TOKENS)
    dummies: list[tuple[list[int], MultimodalParams | None]] = []
    text_ids = input_processor.get_dummy_prompt(budget)
    if engine.use_mrope:
        ids, extra = input_processor({"prompt_token_ids": text_ids}, None)
        dummies.append((ids, MultimodalParams(extra["multimodal_data"])))
    else:
        dummies.append((list(text_ids), None))
    if has_vision and hasattr(input_processor, "get_dummy_multimodal_prompt"):
        # Leave room for the chat-template text around the image block.
        image_budget = max(budget - 64, 4) if engine.device.type == "cuda" else 16
        ids, extra = input_processor(
            input_processor.get_dummy_multimodal_prompt(image_budget), None
        )
        if len(ids) + 2 > max_seq_len:  # prompt, one decode step, the overlap's spare token
            raise ValueError(
                f"max_seq_len={max_seq_len} cannot hold the smallest image prompt of this "
                f"checkpoint ({len(ids)} tokens with its chat template) plus a generated token; "
                f"raise max_seq_len"
            )
        dummies.append((ids, MultimodalParams(extra["multimodal_data"])))
    return dummies


@torch.no_grad()
def _check_quant_config(config: EngineConfig) -> QuantConfig | None:
    quant = config.quant_config
    if quant is not None and config.quantization == "fp8":
        raise ValueError("quantization='fp8' cannot apply to a block-FP8 model")
    return quant


def _final_sizing(
    config: EngineConfig, presized: BatchSizing | None, num_slots: int, num_blocks: int
) -> BatchSizing:
    if config.max_batch_size is not None:
        return BatchSizing(config.max_batch_size, "max_batch_size")
    if presized is not None:
        return presized
    if config.device.type != "cuda":
        return BatchSizing(num_slots, "cpu default")
    typical = typical_request_tokens(config.max_seq_len)
    return size_from_kv(num_slots, num_blocks, config.tokens_per_block, typical)


def _final_max_seq_len(
    config: EngineConfig, engine: PyTorchModelEngine, num_blocks: int, longest_dummy: int
) -> SeqLenSizing:
    """max_seq_len after KV sizing (a default capped by the cache), checked to still hold the
    capacity probe's requests (one decode step and the overlap's spare token included)."""
    kv_tokens = min(num_blocks, engine.max_blocks_per_seq) * config.tokens_per_block
    sizing = cap_max_seq_len(
        config.max_seq_len,
        config.max_seq_len_source,
        kv_tokens,
        config.kv_cache_free_gpu_memory_fraction,
        getattr(config.text_config, "max_position_embeddings", None),
    )
    if sizing.max_seq_len < longest_dummy + 2:
        raise RuntimeError(
            f"the KV cache holds {kv_tokens} tokens, too few for the capacity probe's "
            f"{longest_dummy}-token request plus a generated token; raise "
            "kv_cache_free_gpu_memory_fraction or kv_cache_max_tokens, or lower max_num_tokens"
        )
    return sizing


def _capture_piecewise(
    config: EngineConfig, engine: PyTorchModelEngine
) -> PiecewiseCUDAGraphRunner | None:
    """The piecewise prefill/mixed graphs, captured now (before the KV cache is sized), or None."""
    max_tokens = config.piecewise_max_tokens
    if max_tokens is None:
        # The default: on where the model can run them, measured faster for prefill and
        # mixed steps up to ~2048 tokens (benchmarks/results/qwen3_vl_8b_h200.md, run 13).
        reason = why_not_piecewise(engine.model)
        if reason:
            logger.info("piecewise CUDA graphs off: %s", reason)
            return None
        max_tokens = min(DEFAULT_PIECEWISE_MAX_TOKENS, config.max_num_tokens)
    if not max_tokens:
        return None
    # A limit set explicitly on an ineligible model raises here (not a silent eager path).
    # Captured before the KV cache is sized, so the graphs' memory pool is counted (no
    # attention runs while capturing: it needs no KV cache). The capacity probe still runs
    # eagerly: the runner joins the engine with the decode graphs.
    piecewise = PiecewiseCUDAGraphRunner(engine, piecewise_token_buckets(max_tokens))
    piecewise.capture_all()
    return piecewise


def _decode_graph_sizes(config: EngineConfig, sizing: BatchSizing) -> list[int]:
    """The decode graph batch sizes: resolved up front, else the defaults up to the sized cap."""
    max_batch_size = sizing.max_batch_size
    if config.cuda_graph_batch_sizes is None:
        return graph_batch_sizes(CudaGraphConfig(), max_batch_size)
    sizes = list(config.cuda_graph_batch_sizes)
    if max(sizes) > max_batch_size:  # only with a sized default
        raise ValueError(
            f"cuda_graph_config captures batch size {max(sizes)}, more than the "
            f"{sizing.describe()}; give max_batch_size explicitly"
        )
    return sizes


def create_py_executor(config: EngineConfig, input_processor: Any) -> PyExecutor:
    """Build, probe, size and start the engine that `config` describes (returned started)."""
    if not isinstance(config, EngineConfig):
        raise TypeError(
            "create_py_executor takes an EngineConfig (LlmArgs.to_engine_config()), got "
            f"{type(config).__name__}"
        )
    device = config.device
    text_config = config.text_config
    check_tp_config(config)
    cls = get_model_class(config.architecture)
    spec = kv_spec_with_mtp(
        KVCacheSpec.from_text_config(text_config, config.kv_cache_dtype, config.mapping.tp_size),
        config,
    )
    model_config, presized = sized_model_config(config, cls, spec)
    num_slots = model_config.max_num_seq_slots
    # The last `scratch` of them hold inner snapshots only (hybrid_kv_cache_reuse.py).
    scratch = snapshot_scratch_slots(config)
    batch_slots = num_slots - scratch
    _check_quant_config(config)
    model = build_model(cls, model_config, device, config)
    table_seq_len = engine_max_seq_len(config, spec)
    engine = PyTorchModelEngine(
        model,
        device,
        max_num_tokens=config.max_num_tokens,
        max_batch_size=num_slots,
        max_seq_len=table_seq_len,
        tokens_per_block=config.tokens_per_block,
        tokens_per_generation=verify_tokens_per_request(config),
    )
    attach_step_channel(engine, config)  # tensor parallelism: rank 0 sends every step
    warmed = warmup_enabled(device)
    # Before the first forward (graph capture, probe): fla's first calls tune here.
    tuning = StartupTuning.begin(device) if warmed else None
    piecewise = _capture_piecewise(config, engine) if config.use_cuda_graph else None
    has_vision = engine.model.has_vision
    dummies = _dummy_requests(input_processor, engine, table_seq_len, has_vision)
    peak = run_capacity_probe(engine, spec, dummies, config.tokens_per_block)
    activation = max(0, peak - torch.cuda.memory_allocated(device)) if peak else 0
    reuse_on = config.enable_block_reuse
    embed_cache_bytes = config.vision_embedding_cache_bytes if reuse_on and has_vision else 0
    if embed_cache_bytes:
        # Its tensors grow as images arrive: reserved like the probe's peak, before KV sizing.
        cast(Any, engine.model).vision_embedding_cache = VisionEmbeddingCache(embed_cache_bytes)
        if engine.step_channel is not None:
            # Each rank mirrors it from this step on: the data-parallel tower needs every rank
            # to skip the same cached items (tp_worker.py).
            engine.step_channel.send_vision_cache(embed_cache_bytes)
    # Allocated now, so the KV cache is sized from what it leaves (hybrid_kv_cache_reuse.py).
    snapshots = make_snapshot_pool(config, engine, batch_slots) if reuse_on else None
    # MTP speculation also keeps a full batch's recurrent-state snapshot (spec_decode/).
    reserved = embed_cache_bytes + snapshot_reserve_bytes(config, engine.model, num_slots)
    num_blocks = choose_num_blocks(
        spec,
        device,
        config.tokens_per_block,
        batch_slots,
        engine.max_blocks_per_seq,
        config.kv_cache_free_gpu_memory_fraction,
        config.kv_cache_max_tokens,
        activation_peak_bytes=activation + reserved,
        seq_len_capped_after=config.max_seq_len_source != MAX_SEQ_LEN_USER,
    )
    # Tensor parallelism: the least any rank's memory fits (no-op on one GPU).
    num_blocks = agree_num_blocks(
        engine, num_blocks, reserved, config.max_seq_len_source != MAX_SEQ_LEN_USER
    )
    seq_len = _final_max_seq_len(config, engine, num_blocks, max(len(d[0]) for d in dummies))
    logger.info("%s", seq_len.describe())
    max_seq_len = seq_len.max_seq_len
    blocks_per_seq = -(-max_seq_len // config.tokens_per_block)
    sizing = _final_sizing(config, presized, batch_slots, num_blocks)
    max_batch_size = sizing.max_batch_size
    logger.info(
        "capacity probe: %d dummy requests ok, peak %.1f MiB (activations %.1f MiB); KV cache: "
        "%d blocks of %d tokens; %s",
        len(dummies),
        peak / 2**20,
        activation / 2**20,
        num_blocks,
        config.tokens_per_block,
        sizing.describe(),
    )
    kv = spec.make_manager(
        config.tokens_per_block, num_blocks, blocks_per_seq, device, enable_block_reuse=reuse_on
    )
    engine.set_kv_cache_manager(kv)
    # NOTE: the engine and the model keep `num_slots` rows (the dummy slot is the last one);
    # the scheduler hands out only the first `max_batch_size` of them, the scratch slots are
    # the last `scratch` before the dummy.
    slots = SeqSlotManager(max_batch_size)
    vision = getattr(config.pretrained_config, "vision_config", None)
    merge = int(getattr(vision, "spatial_merge_size", None) or 1)
    scheduler = SimpleScheduler(
        max_batch_size,
        config.max_num_tokens,
        config.enable_chunked_prefill,
        kv,
        slots,
        reuse=(
            make_kv_cache_reuse(kv, snapshots, merge, range(batch_slots, num_slots))
            if reuse_on
            else None
        ),
        guaranteed_no_evict=config.guaranteed_no_evict,
    )
    sampler = TorchSampler(engine.vocab_size, device)
    # With speculation every decode step verifies drafts: its graphs are the verify graphs
    # (steps of verify rows alone); other steps and rollback replays run piecewise.
    if config.use_cuda_graph and config.speculative_config is None:
        engine.cuda_graph_runner = CUDAGraphRunner(
            engine, _decode_graph_sizes(config, sizing), config.cuda_graph_padding_enabled
        )
        engine.cuda_graph_runner.capture_all()
    elif config.use_cuda_graph:
        capture_verify_graphs(engine, config, _decode_graph_sizes(config, sizing))
    engine.piecewise_graph_runner = piecewise
    if warmed:  # after graph capture: each warm-up step takes its served path
        run_warmup(engine, input_processor, kv, max_batch_size, max_seq_len, tuning)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    executor_cls = PyExecutor if config.disable_overlap_scheduler else OverlapPyExecutor
    executor = executor_cls(
        engine, scheduler, sampler, kv, slots, max_seq_len, stream_interval=config.stream_interval
    )
    # Cheap until the first guided request (xgrammar and its tokenizer info load lazily).
    executor.guided_decoder = GuidedDecoder(
        getattr(input_processor, "tokenizer", None), engine.vocab_size
    )
    attach_spec_decoder(executor, config)
    logger.info("%s", startup_summary(config, engine, max_seq_len, max_batch_size, num_blocks))
    executor.start()
    if warmed:
        if executor.spec_decoder is not None:
            try:  # the steps only speculation runs: draft passes, checks, rollbacks
                run_spec_warmup(executor, input_processor, max_batch_size)
            except BaseException:
                executor.shutdown()
                raise
        arm_step_compile_guard(executor.loop_thread)
    return executor


def startup_summary(
    config: EngineConfig,
    engine: PyTorchModelEngine,
    max_seq_len: int,
    max_batch_size: int,
    num_blocks: int,
) -> str:
    """The one line that says what this engine is: model, sizes, cache, graphs, quantization."""
    graphs = engine.cuda_graph_runner
    piecewise = engine.piecewise_graph_runner
    quant = config.quantization or ("fp8_block (checkpoint)" if config.quant_config else "none")
    return (
        f"engine ready: model={config.checkpoint_dir} architecture={config.architecture} "
        f"dtype={str(config.dtype).removeprefix('torch.')} device={config.device} "
        f"attn_backend={config.attn_backend} max_seq_len={max_seq_len} "
        f"max_batch_size={max_batch_size} max_num_tokens={config.max_num_tokens} "
        f"kv_cache={num_blocks}x{config.tokens_per_block} tokens "
        f"({str(config.kv_cache_dtype).removeprefix('torch.')}) "
        f"decode_graphs={graphs.batch_sizes if graphs is not None else 'off'} "
        f"piecewise_graphs={piecewise.buckets[-1] if piecewise is not None else 'off'} "
        f"quantization={quant} overlap={not config.disable_overlap_scheduler} "
        f"block_reuse={config.enable_block_reuse}"
        + (
            f" ssm_state={str(config.ssm_state_dtype).removeprefix('torch.')}"
            if is_hybrid_model(config.pretrained_config)
            else ""
        )
    )
