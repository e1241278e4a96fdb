"""create_py_executor: checkpoint folder + LlmArgs -> a running PyExecutor.

Order matters: build the model (meta init, then weights), run the capacity probe with a
text-only and a multimodal dummy request, size the KV cache from what is left, then start the loop.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ...inputs.multimodal import MultimodalParams
from ..attention_backend import ATTENTION_BACKENDS
from ..config_utils import load_pretrained_config, resolve_architecture
from ..models.modeling_auto import get_model_class
from ..models.modeling_utils import ModelConfig
from ..modules.linear import quantize_model_fp8_
from ..weight_loading import build_model_on_meta, load_model
from .capacity import (
    BatchSizing,
    batch_size_cap,
    estimate_weight_bytes,
    recurrent_state_bytes_per_slot,
    size_from_kv,
    size_hybrid_slots,
    typical_request_tokens,
)
from .cuda_graph_runner import CUDAGraphRunner, graph_batch_sizes
from .kv_cache_creator import KVCacheSpec, choose_num_blocks, kv_bytes_per_token, run_capacity_probe
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

if TYPE_CHECKING:
    from ...llmapi.llm_args import LlmArgs

logger = logging.getLogger(__name__)

# The text-only dummy is a full max_num_tokens prefill on GPU (that is what peaks memory);
# on the CPU there is no device pool to measure, so a short one proves the route works.
_CPU_TEXT_DUMMY_TOKENS = 32


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


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


def _resolve_attn_backend(requested: str, device: torch.device) -> str:
    """'auto' is the Triton backend on CUDA and the torch reference on the CPU."""
    if requested == "flash_attn" and device.type != "cuda":
        raise ValueError(f"attn_backend 'flash_attn' runs on CUDA only, not on {device}")
    if requested != "auto":
        return requested
    if device.type == "cuda" and "triton" in ATTENTION_BACKENDS:
        return "triton"
    return "vanilla"


@torch.no_grad()
def _fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights at real sizes (benchmarks): small normal matrices, unit norms, zero biases.

    Generated where the parameter lives: host-side generation of billions of values is slow.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)


def _build_model(
    cls: type, model_config: ModelConfig, device: torch.device, load_format: str, seed: int
) -> torch.nn.Module:
    if load_format == "dummy":
        model = build_model_on_meta(cls, model_config, device)
        _fill_dummy_weights(model, seed)
        return model.eval()
    return load_model(cls, model_config, device)


def _presize_hybrid(
    args: LlmArgs,
    cls: type,
    model_config: ModelConfig,
    spec: KVCacheSpec,
    text_config: Any,
    max_seq_len: int,
    device: torch.device,
) -> BatchSizing | None:
    """Seq slots of a hybrid model on CUDA when max_batch_size is not given (see capacity.py);
    None for every other case."""
    state = recurrent_state_bytes_per_slot(text_config, model_config.torch_dtype)
    if args.max_batch_size is not None or device.type != "cuda" or not state:
        return None
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    probe_config = replace(model_config, max_num_seq_slots=1)
    return size_hybrid_slots(
        model_config.max_num_seq_slots,
        free,
        estimate_weight_bytes(cls, probe_config),
        args.kv_cache_free_gpu_memory_fraction,
        state,
        kv_bytes_per_token(spec),
        typical_request_tokens(max_seq_len),
    )


def _final_sizing(
    args: LlmArgs,
    presized: BatchSizing | None,
    num_slots: int,
    num_blocks: int,
    max_seq_len: int,
    device: torch.device,
) -> BatchSizing:
    if args.max_batch_size is not None:
        return BatchSizing(args.max_batch_size, "max_batch_size")
    if presized is not None:
        return presized
    if device.type != "cuda":
        return BatchSizing(num_slots, "cpu default")
    typical = typical_request_tokens(max_seq_len)
    return size_from_kv(num_slots, num_blocks, args.tokens_per_block, typical)


def create_py_executor(args: LlmArgs, input_processor: Any) -> PyExecutor:
    config = load_pretrained_config(args.model)
    text_config = _text_config(config)
    cls = get_model_class(resolve_architecture(config))
    device = args.resolve_device()
    dtype = args.resolve_dtype(
        getattr(config, "dtype", None) or getattr(text_config, "dtype", None)
    )
    max_seq_len = args.resolve_max_seq_len(getattr(text_config, "max_position_embeddings", None))
    attn_backend = _resolve_attn_backend(args.attn_backend, device)
    kv_dtype = args.resolve_kv_cache_dtype(dtype)
    spec = KVCacheSpec.from_text_config(text_config, kv_dtype)
    model_config = ModelConfig(
        pretrained_config=config,
        torch_dtype=dtype,
        attn_backend=attn_backend,
        max_num_seq_slots=batch_size_cap(args.max_batch_size, device),
        max_num_tokens=args.max_num_tokens,
        checkpoint_dir=args.model,
    )
    presized = _presize_hybrid(args, cls, model_config, spec, text_config, max_seq_len, device)
    if presized is not None:
        model_config = replace(model_config, max_num_seq_slots=presized.max_batch_size)
    num_slots = model_config.max_num_seq_slots
    model = _build_model(cls, model_config, device, args.load_format, args.seed or 0)
    if args.quantization == "fp8":
        converted = quantize_model_fp8_(model)
        logger.info("fp8: quantised %d linear layers of the text decoder", converted)
    engine = PyTorchModelEngine(
        model,
        device,
        max_num_tokens=args.max_num_tokens,
        max_batch_size=num_slots,
        max_seq_len=max_seq_len,
        tokens_per_block=args.tokens_per_block,
    )
    graphs = args.cuda_graph_config
    piecewise = None
    if device.type == "cuda" and graphs is not None and attn_backend != "vanilla":
        max_tokens = graphs.piecewise_max_tokens
        if max_tokens is None:
            # The default: on where the model can run them, measured faster for prefill and
            # mixed steps up to ~2048 tokens (benchmarks/results/qwen3_vl_8b_h200.md, run 13).
            reason = why_not_piecewise(engine.model)
            if reason:
                logger.info("piecewise CUDA graphs off: %s", reason)
                max_tokens = 0
            else:
                max_tokens = min(DEFAULT_PIECEWISE_MAX_TOKENS, args.max_num_tokens)
        if max_tokens:
            # A limit set explicitly on an ineligible model raises here (not a silent eager
            # path). Captured before the KV cache is sized, so the graphs' memory pool is counted
            # (no attention runs while capturing: it needs no KV cache). The capacity probe
            # still runs eagerly: the runner joins the engine with the decode graphs.
            piecewise = PiecewiseCUDAGraphRunner(engine, piecewise_token_buckets(max_tokens))
            piecewise.capture_all()
    has_vision = getattr(model, "visual", None) is not None
    dummies = _dummy_requests(input_processor, engine, max_seq_len, has_vision)
    peak = run_capacity_probe(engine, spec, dummies, args.tokens_per_block)
    activation = max(0, peak - torch.cuda.memory_allocated(device)) if peak else 0
    num_blocks = choose_num_blocks(
        spec,
        device,
        args.tokens_per_block,
        num_slots,
        engine.max_blocks_per_seq,
        args.kv_cache_free_gpu_memory_fraction,
        args.kv_cache_max_tokens,
        activation_peak_bytes=activation,
    )
    sizing = _final_sizing(args, presized, num_slots, num_blocks, max_seq_len, device)
    max_batch_size = sizing.max_batch_size
    logger.info(
        "capacity probe: %d dummy requests ok, peak %.1f MiB (activations %.1f MiB); KV cache: "
        "%d blocks of %d tokens; %s",
        len(dummies),
        peak / 2**20,
        activation / 2**20,
        num_blocks,
        args.tokens_per_block,
        sizing.describe(),
    )
    kv = spec.make_manager(args.tokens_per_block, num_blocks, engine.max_blocks_per_seq, device)
    engine.set_kv_cache_manager(kv)
    # NOTE: the engine and the model keep `num_slots` rows (the dummy slot is the last one);
    # the scheduler hands out only the first `max_batch_size` of them.
    slots = SeqSlotManager(max_batch_size)
    scheduler = SimpleScheduler(
        max_batch_size, args.max_num_tokens, args.enable_chunked_prefill, kv, slots
    )
    vocab_size = int(getattr(model, "vocab_size", None) or text_config.vocab_size)
    sampler = TorchSampler(vocab_size, device)
    if device.type == "cuda" and graphs is not None and attn_backend != "vanilla":
        if graphs.largest(max_batch_size) > max_batch_size:  # only with a sized default
            raise ValueError(
                f"cuda_graph_config captures batch size {graphs.largest(max_batch_size)}, more "
                f"than the {sizing.describe()}; give max_batch_size explicitly"
            )
        # NOTE: the vanilla backend syncs (boolean masks), so it cannot be captured.
        engine.cuda_graph_runner = CUDAGraphRunner(
            engine, graph_batch_sizes(graphs, max_batch_size), graphs.enable_padding
        )
        engine.cuda_graph_runner.capture_all()
        engine.piecewise_graph_runner = piecewise
    if device.type == "cuda":
        torch.cuda.empty_cache()
    executor_cls = PyExecutor if args.disable_overlap_scheduler else OverlapPyExecutor
    executor = executor_cls(engine, scheduler, sampler, kv, slots, max_seq_len)
    executor.start()
    return executor
