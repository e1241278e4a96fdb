"""EngineConfig: everything startup needs, resolved once before the model is built.

`LlmArgs.to_engine_config()` (llmapi) reads the checkpoint's config and resolves the user's
knobs against it ("auto" dtype, device, attention backend, the context length, the decode graph
sizes where the user fixed them); `create_py_executor(config, input_processor)` reads nothing
else. The engine side therefore never imports `llmapi` (a test checks it), and no startup step
re-derives a value another one already chose.

What only the capacity probe can tell (the final `max_batch_size`, the KV-cache blocks, the
default decode graph sizes that follow the sized batch) stays a result of startup, not a field.

`CudaGraphConfig`, the user-facing graph knobs, lives here so that the graph runners can name
it; `tensorrt_llm.llmapi.llm_args` re-exports it for users.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...mapping import Mapping
from ..quantization import QuantConfig
from .spec_decode.config import MTPDecodingConfig

# Where EngineConfig.max_seq_len came from. Every source but the user's is a default that the
# KV cache caps at startup (create_py_executor) to what it holds for one sequence.
MAX_SEQ_LEN_USER = "max_seq_len"
MAX_SEQ_LEN_CONFIG = "max_position_embeddings"
MAX_SEQ_LEN_CPU_CAP = "cpu cap"  # the config's, capped: the CPU cache is a full batch at it
MAX_SEQ_LEN_FALLBACK = "fallback"  # the config gives no context length


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    """ValueError naming `name` unless `value` is an int >= minimum (or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class CudaGraphConfig:
    """Decode CUDA graphs (CUDA with the triton attention backend; ignored on the CPU).

    `batch_sizes`: the batch sizes to capture (None: 1, 2, 4, 8, 16, 24, 32, 48, ... up to
    `max_batch_size`, which is included). `max_batch_size`: the largest size captured when
    `batch_sizes` is None (None: `LlmArgs.max_batch_size`). `enable_padding`: a batch runs in
    the smallest captured graph that holds it, its extra rows padded; False replays only
    exact sizes and runs other batches eagerly. `LlmArgs.cuda_graph_config=None` turns graphs
    off.

    `piecewise_max_tokens`: also capture steps with context chunks (prefill and mixed) of up
    to this many tokens, as piecewise graphs per token bucket with the attention run eagerly
    between them (`pyexecutor/piecewise_graph_runner.py`); their pool takes memory beside the
    KV cache. None (the default): up to min(2048, max_num_tokens) tokens on dense Qwen-VL
    models, off (with a log line saying why) on the others. 0: off. A positive value on a
    model that cannot run them is an error.
    """

    batch_sizes: list[int] | None = None
    max_batch_size: int | None = None
    enable_padding: bool = True
    piecewise_max_tokens: int | None = None

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if sizes is not None:
            if not isinstance(sizes, list | tuple) or not sizes:
                raise ValueError(
                    f"cuda_graph_config.batch_sizes must be a non-empty list, got {sizes!r}"
                )
            for b in sizes:
                check_int("cuda_graph_config.batch_sizes entry", b, 1)
        check_int("cuda_graph_config.max_batch_size", self.max_batch_size, 1, allow_none=True)
        if not isinstance(self.enable_padding, bool):
            raise ValueError(
                f"cuda_graph_config.enable_padding must be a bool, got {self.enable_padding!r}"
            )
        check_int(
            "cuda_graph_config.piecewise_max_tokens", self.piecewise_max_tokens, 0, allow_none=True
        )

    def largest(self, engine_max_batch_size: int) -> int:
        """The biggest batch a graph is captured for."""
        if self.batch_sizes is not None:
            return max(self.batch_sizes)
        return self.max_batch_size or engine_max_batch_size


@dataclass(frozen=True)
class EngineConfig:
    """The resolved startup configuration of one engine (see the module docstring)."""

    # The local checkpoint folder the weights (and the processor files) are read from.
    checkpoint_dir: str
    # The model-registry key the checkpoint routes to (`config_utils.resolve_architecture`).
    architecture: str
    # The HF config as loaded (`load_pretrained_config`, carrying its route); left out of
    # eq/repr: it is large, and the other fields already say what was resolved from it.
    pretrained_config: Any = field(compare=False, repr=False)
    # Where the model runs ("auto" resolved: CUDA when present).
    device: torch.device
    # The model dtype ("auto": the checkpoint's on CUDA, float32 on the CPU).
    dtype: torch.dtype
    # The KV-cache element type (the model dtype, or e4m3 for kv_cache_dtype="fp8").
    kv_cache_dtype: torch.dtype
    # Longest request (prompt + generated): the user's, else the config's context length (on
    # the CPU capped at a default); a default is capped again by the KV cache at startup.
    max_seq_len: int
    # Most tokens one step schedules (also the text-only dummy of the capacity probe).
    max_num_tokens: int
    # Tokens per KV-cache block.
    tokens_per_block: int
    # The user's max_batch_size; None: sized at startup from the KV cache (and recurrent state).
    max_batch_size: int | None
    # Seq slots the model and the engine are built with before any sizing: max_batch_size, or
    # the device's cap (`capacity.batch_size_cap`). Hybrid models may get fewer (presizing).
    batch_size_cap: int
    # Share of the memory left after the weights and the probe's peak that the KV cache takes.
    kv_cache_free_gpu_memory_fraction: float
    # Hard cap on KV-cache tokens (None: the memory fraction alone decides).
    kv_cache_max_tokens: int | None
    # The attention backend's registry name, "auto" resolved ("triton" on CUDA, else "vanilla").
    attn_backend: str
    # "auto": the checkpoint's safetensors; "dummy": random weights at real sizes.
    load_format: str
    # Seed of the dummy-weight generator (LlmArgs.seed, 0 when not given).
    seed: int
    # None, "fp8" (per-channel e4m3 weights and per-token activations in the text decoder's
    # linears, converted after loading) or "fp8_block" (the user's LlmArgs.quantization).
    quantization: str | None
    # Whether a prompt longer than max_num_tokens is prefilled over several steps.
    enable_chunked_prefill: bool
    # True: `PyExecutor` (syncs each step); False: `OverlapPyExecutor` (the default).
    disable_overlap_scheduler: bool
    # Decode CUDA graphs: a CudaGraphConfig was given AND the engine can capture (CUDA and a
    # backend that does not sync; vanilla does). False turns every graph off, piecewise too.
    use_cuda_graph: bool
    # Decode graph batch sizes (`graph_batch_sizes`), sorted, when known before sizing (the
    # user's list, the graph config's cap or max_batch_size); None: the defaults up to the
    # max_batch_size sized at startup. None as well when use_cuda_graph is False.
    cuda_graph_batch_sizes: tuple[int, ...] | None
    # A batch replays in the smallest graph that holds it (else exact sizes only).
    cuda_graph_padding_enabled: bool
    # Piecewise prefill/mixed graphs: 0 off, N the largest token bucket; None: the default,
    # min(2048, max_num_tokens) where the built model can run them (decided after the build).
    piecewise_max_tokens: int | None
    # Block-FP8 linears (`_torch/quantization.py`): the checkpoint's quantization_config, or
    # the releases' layout for quantization="fp8_block" on 16-bit / random weights; None: none.
    quant_config: QuantConfig | None = None
    # Where max_seq_len came from (MAX_SEQ_LEN_*); anything but MAX_SEQ_LEN_USER is capped by
    # what the sized KV cache holds for one sequence.
    max_seq_len_source: str = MAX_SEQ_LEN_USER
    # Admission reserves each request's prompt + max_tokens blocks up front and never
    # preempts (scheduler_config GUARANTEED_NO_EVICT); False: blocks on demand.
    guaranteed_no_evict: bool = False
    # KV block reuse (prefix caching), resolved (`LlmArgs`, llmapi/reuse_args.py).
    enable_block_reuse: bool = False
    # Bytes of the vision-embedding cache (used with block reuse on a model with a tower).
    vision_embedding_cache_bytes: int = 0
    # Bytes of the recurrent-state snapshot pool (used with block reuse on a hybrid model);
    # None: `hybrid_kv_cache_reuse.default_snapshot_pool_bytes`.
    recurrent_state_snapshot_bytes: int | None = None
    # MTP speculative decoding (spec_decode/config.py), checked against the checkpoint; None: off.
    speculative_config: MTPDecodingConfig | None = None
    # Hybrid models' Gated DeltaNet state element type (LlmArgs.mamba_ssm_cache_dtype).
    ssm_state_dtype: torch.dtype = torch.float32
    # Output tokens a running request's response waits for after its first (LlmArgs's).
    stream_interval: int = 1
    # This process's rank of a tensor-parallel engine (default: one GPU). Rank 0 runs the
    # executor (`create_py_executor`), the others `tp_worker.run_tp_worker`.
    mapping: Mapping = field(default_factory=Mapping)

    @property
    def text_config(self) -> Any:
        """The text decoder's HF config (the top-level config of text-only checkpoints)."""
        return getattr(self.pretrained_config, "text_config", None) or self.pretrained_config
