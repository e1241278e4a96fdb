"""LlmArgs: the validated knobs of `LLM(...)`, checked once at construction.

Every field is validated in `__post_init__` with a ValueError that names the field, and
`LlmArgs.from_kwargs` rejects unknown keyword arguments, listing the valid ones. The object is
frozen: nobody mutates it. `to_engine_config()` resolves it, with the checkpoint's config, into
the engine's frozen `EngineConfig` (`_torch/pyexecutor/engine_config.py`), the one object
`create_py_executor` reads; the `resolve_*` helpers are its steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .._torch.attention_backend import ATTENTION_BACKENDS
from .._torch.pyexecutor.capacity import batch_size_cap
from .._torch.pyexecutor.engine_config import (
    MAX_SEQ_LEN_CONFIG,
    MAX_SEQ_LEN_CPU_CAP,
    MAX_SEQ_LEN_FALLBACK,
    MAX_SEQ_LEN_USER,
    CudaGraphConfig,
    EngineConfig,
)
from .._torch.pyexecutor.engine_config import check_int as _check_int
from .._torch.pyexecutor.spec_decode.config import (
    MTPDecodingConfig,
    check_speculative_support,
    parse_speculative_config,
)
from .._torch.quantization import QUANTIZATION_MODES, resolve_quant_config
from ..inputs.validation import check_mm_processor_kwargs
from .args_checks import (
    MODALITIES,  # noqa: F401 (re-exported: it moved to args_checks.py)
    check_choice,
    check_triton_device,
    normalize_cuda_graph_config,
    note_unused_device_knobs,
    validate_flash_attn,
    validate_mm_limits,
    validate_paths,
)
from .generation_defaults import GENERATION_CONFIG_MODES
from .reuse_args import (
    recurrent_state_snapshot_bytes,
    resolve_block_reuse,
    vision_embedding_cache_bytes,
)
from .scheduler_args import CapacitySchedulerPolicy, SchedulerConfig, resolve_scheduler_config
from .upstream_args import KvCacheConfig, apply_upstream_fields, engine_mapping

DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn}
# The Gated DeltaNet (SSM) state of hybrid models: "auto" takes the checkpoint's
# `mamba_ssm_dtype` and else float32, the precision the state accumulates in over a whole
# sequence; 16-bit halves its bytes (the decode step reads and writes every running request's
# state in each DeltaNet layer).
SSM_STATE_DTYPES: dict[str, torch.dtype] = {
    "auto": torch.float32,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# "flash_attn" is opt-in (never picked by "auto"): it needs the flash-attn package, which
# neither of this project's machines has, so it is tested against a stand-in only.
ATTN_BACKENDS = ("auto", "vanilla", "triton", "flash_attn")
# "inproc": the executor loop runs in a thread of the caller's process; "process": in a child
# process (tensorrt_llm/executor/), so the front end's GIL never slows the engine loop.
EXECUTOR_MODES = ("inproc", "process")
_BOOL_FIELDS = (
    "enable_chunked_prefill",
    "disable_overlap_scheduler",
    "trust_remote_code",
)
# NOTE: when max_seq_len is not given, the config's max_position_embeddings (often 128k+) is
# taken in full on CUDA, where the sized KV cache caps it at startup; elsewhere (the CPU, whose
# cache is a full batch at max_seq_len, not sized from memory) it is capped here so that the KV
# cache of a default LLM(...) stays a sane size.
DEFAULT_MAX_SEQ_LEN_CAP = 8192
# Used when neither the user nor the config gives a context length.
FALLBACK_MAX_SEQ_LEN = 4096


@dataclass(frozen=True)
class LlmArgs:
    """Arguments of `tensorrt_llm.LLM`. See the README for what each knob does."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # None: sized at startup from the KV cache and per-slot state (8 on the CPU, <= 512 on CUDA).
    max_batch_size: int | None = None
    max_num_tokens: int = 4096
    # None: max_position_embeddings of the checkpoint's (text) config, capped by what the KV
    # cache holds for one sequence (CUDA) or at DEFAULT_MAX_SEQ_LEN_CAP (CPU).
    max_seq_len: int | None = None
    kv_cache_free_gpu_memory_fraction: float = 0.9
    # Hard cap on KV-cache tokens (None: size from the memory fraction only).
    kv_cache_max_tokens: int | None = None
    tokens_per_block: int = 32
    # KV block reuse (prefix caching): full blocks of finished or preempted requests stay
    # cached and a request with the same prefix (same tokens, same images) skips their
    # prefill. None: on, except on hybrid models (Qwen3.5 / 3.6: off for now, True works
    # through recurrent-state snapshots; reuse_args.HYBRID_BLOCK_REUSE_DEFAULT).
    enable_block_reuse: bool | None = None
    # With block reuse: MiB of vision-tower outputs kept by image content hash, so a repeated
    # image whose KV was evicted (or a hit ending inside an image) skips the tower. Reserved
    # before the KV cache is sized on CUDA. None: 512 on CUDA, 64 on the CPU; 0: off.
    vision_embedding_cache_mib: int | None = None
    # With block reuse on a hybrid model: MiB of DeltaNet conv / SSM state snapshots at block
    # boundaries of cached prefixes (a hit needs one at its end), allocated before the KV
    # cache is sized. None: on CUDA 20% of the memory free then, at most 16384; 256 on the
    # CPU. Must hold at least one snapshot.
    recurrent_state_snapshot_mib: int | None = None
    # On by default: a long prompt then shares steps with decodes instead of stalling them,
    # and a preempted request's recompute (prompt + outputs) may exceed max_num_tokens.
    enable_chunked_prefill: bool = True
    attn_backend: str = "auto"
    # Decode CUDA graphs (a CudaGraphConfig, or a dict of its fields); None turns them off.
    cuda_graph_config: CudaGraphConfig | None = field(default_factory=CudaGraphConfig)
    # "fp8": e4m3 weights (per-channel) and activations (per-token) in the text decoder, on a
    # 16-bit checkpoint. "fp8_block": 128 x 128 block-scaled e4m3 weights and per-token-group
    # activations (the Qwen -FP8 releases' layout), converted at load. None: the checkpoint as
    # it is (block-FP8 when its config.json has a quantization_config).
    quantization: str | None = None
    # "auto": the KV cache takes the model dtype. "fp8": e4m3 K/V (half the bytes: twice the
    # cached tokens and half the decode-attention traffic); values are stored unscaled and
    # saturate at +-448, which suits q/k-normed models such as Qwen3-VL and Qwen3.5.
    kv_cache_dtype: str = "auto"
    # The element type of hybrid models' recurrent (SSM) state, `SSM_STATE_DTYPES`; anything
    # but "auto" on a model without one is an error (TensorRT-LLM's
    # `KvCacheConfig.mamba_ssm_cache_dtype`).
    mamba_ssm_cache_dtype: str = "auto"
    # The overlap scheduler prepares step n+1 while step n runs on the device.
    disable_overlap_scheduler: bool = False
    # TensorRT-LLM's (and vLLM's --stream-interval): after a request's first token the engine
    # sends its new tokens every `stream_interval` tokens (the last response whatever it
    # holds). 1 streams every token; larger values cut the per-token work of the front end
    # and the engine's responses at high concurrency, at the cost of burstier streams.
    stream_interval: int = 1
    # "auto" reads the checkpoint's safetensors; "dummy" fills random weights (benchmarks).
    load_format: str = "auto"
    # Max items per prompt for each modality, e.g. {"image": 4, "video": 1}; None = unlimited.
    limit_mm_per_prompt: dict[str, int] | None = None
    seed: int | None = None
    trust_remote_code: bool = False
    # Free-form kwargs forwarded to the HF processor (e.g. min_pixels/max_pixels).
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    # Where the executor runs: EXECUTOR_MODES. "process" (the default, on CUDA and on CPU): in
    # its own process. "inproc": in this process, for debugging and for tests that look inside
    # the engine (its model, KV cache, executor class).
    executor_mode: str = "process"
    # "auto": the checkpoint's generation_config.json gives the defaults of fields a request
    # leaves unset (temperature, top_p, top_k, do_sample=false greedy, eos ids); "ignore": not.
    generation_config: str = "auto"
    # TensorRT-LLM's spellings (upstream_args.py): "pytorch" only; tensor parallelism on one
    # node (not hybrid stacks; pipeline parallelism is refused); the KV knobs as a
    # KvCacheConfig (or a dict of its fields), moved onto the kv_cache_* fields above.
    backend: str = "pytorch"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # With tensor_parallel_size > 1: "data" splits each step's images over the ranks (the
    # tower's weights whole on each); "weights" (a sharded tower) is refused until it exists.
    mm_encoder_tp_mode: str = "data"
    kv_cache_config: KvCacheConfig | dict[str, Any] | None = None
    # Admission policy (`scheduler_args.py`): None or MAX_UTILIZATION, blocks on demand with
    # preemption; GUARANTEED_NO_EVICT reserves prompt + max_tokens up front (TensorRT-LLM's).
    scheduler_config: SchedulerConfig | dict[str, Any] | None = None
    # Speculative decoding with the checkpoint's MTP head (an MTPDecodingConfig, or a dict of
    # its fields: {"decoding_type": "MTP", "num_nextn_predict_layers": k}); None: off.
    speculative_config: MTPDecodingConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        apply_upstream_fields(self)
        object.__setattr__(
            self, "scheduler_config", resolve_scheduler_config(self.scheduler_config)
        )
        # Normalised once: the dict form becomes the frozen config.
        object.__setattr__(
            self, "speculative_config", parse_speculative_config(self.speculative_config)
        )
        validate_paths(self)
        check_choice("dtype", self.dtype, list(DTYPES))
        check_choice("device", self.device, DEVICES)
        check_choice("attn_backend", self.attn_backend, ATTN_BACKENDS)
        check_choice("load_format", self.load_format, ["auto", "dummy"])
        check_choice("quantization", self.quantization, QUANTIZATION_MODES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, list(KV_CACHE_DTYPES))
        check_choice("mamba_ssm_cache_dtype", self.mamba_ssm_cache_dtype, list(SSM_STATE_DTYPES))
        check_choice("executor_mode", self.executor_mode, EXECUTOR_MODES)
        check_choice("generation_config", self.generation_config, GENERATION_CONFIG_MODES)
        _check_int("max_batch_size", self.max_batch_size, 1, allow_none=True)
        _check_int("max_num_tokens", self.max_num_tokens, 1)
        _check_int("stream_interval", self.stream_interval, 1)
        normalize_cuda_graph_config(self)
        _check_int("max_seq_len", self.max_seq_len, 1, allow_none=True)
        _check_int("kv_cache_max_tokens", self.kv_cache_max_tokens, 1, allow_none=True)
        _check_int("tokens_per_block", self.tokens_per_block, 1)
        if self.attn_backend == "flash_attn":
            validate_flash_attn(self)
        _check_int("seed", self.seed, 0, allow_none=True)
        _check_int(
            "vision_embedding_cache_mib", self.vision_embedding_cache_mib, 0, allow_none=True
        )
        _check_int(
            "recurrent_state_snapshot_mib", self.recurrent_state_snapshot_mib, 1, allow_none=True
        )
        frac = self.kv_cache_free_gpu_memory_fraction
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0.0 < frac <= 1.0:
            raise ValueError(
                f"kv_cache_free_gpu_memory_fraction must be a number in (0, 1], got {frac!r}"
            )
        if self.enable_block_reuse not in (None, True, False):
            reuse = self.enable_block_reuse
            raise ValueError(f"enable_block_reuse must be a bool or None, got {reuse!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        validate_mm_limits(self)
        if not isinstance(self.mm_processor_kwargs, dict):
            kwargs = self.mm_processor_kwargs
            raise ValueError(f"mm_processor_kwargs must be a dict, got {kwargs!r}")
        # The defaults apply to every request: a bad one fails here, not on each request.
        check_mm_processor_kwargs(self.mm_processor_kwargs)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but no CUDA device is available")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LlmArgs:
        """Build from keyword arguments; unknown names raise a ValueError listing valid ones."""
        valid = cls.field_names()
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {unknown}; valid arguments: {valid}")
        if "model" not in kwargs:
            raise ValueError("model is required")
        return cls(**kwargs)

    def resolve_block_reuse(self, config: Any) -> bool:
        """Block reuse for the checkpoint whose HF `config` this is (reuse_args.py)."""
        return resolve_block_reuse(self.enable_block_reuse, self.model, config)

    def resolve_device(self) -> torch.device:
        """'auto' picks CUDA when present, else the CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, config_dtype: torch.dtype | str | None) -> torch.dtype:
        """'auto' uses the checkpoint dtype on GPU and float32 on CPU (CPU half math is slow)."""
        explicit = DTYPES[self.dtype]
        if explicit is not None:
            return explicit
        if self.resolve_device().type == "cpu":
            return torch.float32
        if isinstance(config_dtype, str):
            config_dtype = DTYPES.get(config_dtype.removeprefix("torch."))
        if isinstance(config_dtype, torch.dtype) and config_dtype.is_floating_point:
            return config_dtype
        return torch.bfloat16

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type: the model dtype under 'auto'."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    def resolve_ssm_state_dtype(self, config: Any) -> torch.dtype:
        """The recurrent state's element type for the checkpoint whose HF `config` this is
        ("auto": its `mamba_ssm_dtype`, else float32); a non-"auto" choice for a model that
        keeps no such state is an error, not a no-op."""
        from .._torch.config_utils import checkpoint_ssm_state_dtype, is_hybrid_model

        if self.mamba_ssm_cache_dtype != "auto" and not is_hybrid_model(config):
            raise ValueError(
                f"mamba_ssm_cache_dtype={self.mamba_ssm_cache_dtype!r} applies to hybrid models' "
                "Gated DeltaNet state; this checkpoint has no linear_attention layers (leave it "
                "'auto')"
            )
        if self.mamba_ssm_cache_dtype == "auto" and is_hybrid_model(config):
            wanted = checkpoint_ssm_state_dtype(config)
            if wanted is not None:
                if wanted == "auto" or wanted not in SSM_STATE_DTYPES:
                    choices = [c for c in SSM_STATE_DTYPES if c != "auto"]
                    raise ValueError(
                        f"the checkpoint's config.json sets mamba_ssm_dtype={wanted!r}; "
                        f"supported: {choices} (or override it with mamba_ssm_cache_dtype)"
                    )
                return SSM_STATE_DTYPES[wanted]
        return SSM_STATE_DTYPES[self.mamba_ssm_cache_dtype]

    def resolve_max_seq_len(
        self, config_max_position_embeddings: int | None, kv_bounded: bool = False
    ) -> int:
        """The user's max_seq_len, else the config's context length: in full when the KV cache
        bounds it at startup (`kv_bounded`: CUDA), else capped at DEFAULT_MAX_SEQ_LEN_CAP."""
        return self._max_seq_len_and_source(config_max_position_embeddings, kv_bounded)[0]

    def _max_seq_len_and_source(self, mpe: int | None, kv_bounded: bool) -> tuple[int, str]:
        if self.max_seq_len is not None:
            return self.max_seq_len, MAX_SEQ_LEN_USER
        if not mpe:
            return FALLBACK_MAX_SEQ_LEN, MAX_SEQ_LEN_FALLBACK
        if kv_bounded or int(mpe) <= DEFAULT_MAX_SEQ_LEN_CAP:
            return int(mpe), MAX_SEQ_LEN_CONFIG
        return DEFAULT_MAX_SEQ_LEN_CAP, MAX_SEQ_LEN_CPU_CAP

    def resolve_attn_backend(self, device: torch.device) -> str:
        """'auto' is the Triton backend on CUDA and the torch reference on the CPU."""
        if self.attn_backend == "flash_attn" and device.type != "cuda":
            raise ValueError(f"attn_backend 'flash_attn' runs on CUDA only, not on {device}")
        if self.attn_backend == "triton":
            check_triton_device(device.type)
        if self.attn_backend != "auto":
            return self.attn_backend
        if device.type == "cuda" and "triton" in ATTENTION_BACKENDS:
            return "triton"
        return "vanilla"

    def to_engine_config(self) -> EngineConfig:
        """Resolve these arguments against the checkpoint's config, once, for the engine.

        Runs where the engine runs (the engine process in process mode): the device and the
        dtype depend on that machine.
        """
        # Imported here: transformers and the graph runner are the engine's, not the front
        # end's (preprocess workers unpickle LlmArgs without them).
        from .._torch.config_utils import load_pretrained_config, resolve_architecture
        from .._torch.pyexecutor.cuda_graph_runner import graph_batch_sizes

        config = load_pretrained_config(self.model)
        text_config = getattr(config, "text_config", None) or config
        device = self.resolve_device()
        dtype = self.resolve_dtype(
            getattr(config, "dtype", None) or getattr(text_config, "dtype", None)
        )
        attn_backend = self.resolve_attn_backend(device)
        note_unused_device_knobs(self, device.type, attn_backend)
        cap = batch_size_cap(self.max_batch_size, device)
        # NOTE: the vanilla backend syncs (boolean masks), so it cannot be captured.
        graphs = self.cuda_graph_config
        if device.type != "cuda" or attn_backend == "vanilla":
            graphs = None
        # The decode graph sizes are known now unless they follow a batch sized at startup.
        sizes: tuple[int, ...] | None = None
        if graphs is not None and not (
            self.max_batch_size is None
            and graphs.batch_sizes is None
            and graphs.max_batch_size is None
        ):
            sizes = tuple(graph_batch_sizes(graphs, cap))
        # CUDA sizes the KV cache from memory, which then caps a default max_seq_len.
        max_seq_len, max_seq_len_source = self._max_seq_len_and_source(
            getattr(text_config, "max_position_embeddings", None), device.type == "cuda"
        )
        speculative = self.speculative_config
        assert not isinstance(speculative, dict)  # parsed in __post_init__
        if speculative is not None:
            check_speculative_support(
                speculative,
                text_config,
                max_num_tokens=self.max_num_tokens,
                enable_block_reuse=self.resolve_block_reuse(config),
            )
        return EngineConfig(
            checkpoint_dir=self.model,
            architecture=resolve_architecture(config),
            pretrained_config=config,
            device=device,
            dtype=dtype,
            kv_cache_dtype=self.resolve_kv_cache_dtype(dtype),
            ssm_state_dtype=self.resolve_ssm_state_dtype(config),
            stream_interval=self.stream_interval,
            max_seq_len=max_seq_len,
            max_num_tokens=self.max_num_tokens,
            tokens_per_block=self.tokens_per_block,
            max_batch_size=self.max_batch_size,
            batch_size_cap=cap,
            kv_cache_free_gpu_memory_fraction=float(self.kv_cache_free_gpu_memory_fraction),
            kv_cache_max_tokens=self.kv_cache_max_tokens,
            attn_backend=attn_backend,
            load_format=self.load_format,
            seed=self.seed or 0,
            quantization=self.quantization,
            quant_config=resolve_quant_config(self.quantization, config),
            enable_chunked_prefill=self.enable_chunked_prefill,
            guaranteed_no_evict=self.scheduler_config.capacity_scheduler_policy  # type: ignore[union-attr]
            == CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
            disable_overlap_scheduler=self.disable_overlap_scheduler,
            use_cuda_graph=graphs is not None,
            cuda_graph_batch_sizes=sizes,
            cuda_graph_padding_enabled=graphs.enable_padding if graphs is not None else False,
            piecewise_max_tokens=graphs.piecewise_max_tokens if graphs is not None else 0,
            max_seq_len_source=max_seq_len_source,
            enable_block_reuse=self.resolve_block_reuse(config),
            vision_embedding_cache_bytes=vision_embedding_cache_bytes(
                self.vision_embedding_cache_mib, device
            ),
            recurrent_state_snapshot_bytes=recurrent_state_snapshot_bytes(
                self.recurrent_state_snapshot_mib
            ),
            speculative_config=speculative,
            mapping=engine_mapping(self),
        )


# Upstream name of the PyTorch-backend args.
TorchLlmArgs = LlmArgs
