"""The default batch size: what the KV cache and the per-slot state hold.

`LlmArgs.max_batch_size=None` (the default) sizes the batch at startup instead of fixing it:
- CPU: 8 (there is no device pool to size).
- CUDA: at most 512. The KV cache takes `kv_cache_free_gpu_memory_fraction` of the memory left
  after the weights and the capacity probe's activation peak (kv_cache_creator.py), and the
  batch is the number of typical requests (min(max_seq_len, 2048) tokens each) it holds.
- Hybrid models (Gated DeltaNet) also keep conv/SSM state rows per seq slot. Those rows are
  allocated with the model, before the KV cache can be measured, so their count is decided
  first: free memory minus the weights' bytes as served (a meta build at their final
  precision: FP8 layers at one byte a weight; `model_build.served_weight_bytes`), split over
  typical requests that each need one state row plus their KV.
One startup log line gives the numbers and which bound won.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .engine_config import (
    MAX_SEQ_LEN_CONFIG,
    MAX_SEQ_LEN_CPU_CAP,
    MAX_SEQ_LEN_FALLBACK,
    MAX_SEQ_LEN_USER,
)

logger = logging.getLogger(__name__)

MAX_AUTO_BATCH_SIZE_CUDA = 512
DEFAULT_BATCH_SIZE_CPU = 8
TYPICAL_REQUEST_TOKENS = 2048
# Share of the free memory the hybrid pre-sizing leaves aside for activations, the CUDA graph
# pools and allocator slack (the KV cache itself is measured later, after the probe).
_HYBRID_ACTIVATION_RESERVE = 0.1


@dataclass(frozen=True)
class BatchSizing:
    """The chosen max_batch_size, the bound that set it, and the figures behind it."""

    max_batch_size: int
    bound: str  # "max_batch_size" (the user's), "cpu default", "cap", "kv cache", "recurrent state"
    detail: str = ""

    def describe(self) -> str:
        text = f"max_batch_size {self.max_batch_size} (bound: {self.bound})"
        return f"{text}; {self.detail}" if self.detail else text


def batch_size_cap(requested: int | None, device: torch.device) -> int:
    """The most seq slots the engine is built with: the user's value, else the device's cap."""
    if requested is not None:
        return requested
    return MAX_AUTO_BATCH_SIZE_CUDA if device.type == "cuda" else DEFAULT_BATCH_SIZE_CPU


def typical_request_tokens(max_seq_len: int) -> int:
    return max(1, min(max_seq_len, TYPICAL_REQUEST_TOKENS))


def recurrent_state_bytes_per_slot(
    text_config: Any,
    dtype: torch.dtype,
    tp_size: int = 1,
    ssm_dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes of conv + SSM state one seq slot holds over every DeltaNet layer (0: none), on
    one of `tp_size` tensor-parallel ranks (each holds `1/tp` of the heads and channels).

    NOTE: must match RecurrentStateCache (qwen3_next_recurrent.py): conv rows in the model
    dtype, SSM rows in `ssm_dtype`; a test checks the two agree.
    """
    layer_types = getattr(text_config, "layer_types", None) or []
    num_layers = sum(1 for t in layer_types if t == "linear_attention")
    if not num_layers:
        return 0
    k_heads, v_heads = text_config.linear_num_key_heads, text_config.linear_num_value_heads
    k_dim, v_dim = text_config.linear_key_head_dim, text_config.linear_value_head_dim
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    conv = conv_dim * (text_config.linear_conv_kernel_dim - 1) * dtype.itemsize
    ssm = v_heads * k_dim * v_dim * ssm_dtype.itemsize
    return num_layers * (conv + ssm) // tp_size


def estimate_weight_bytes(
    cls: type, model_config: Any, prepare: Callable[[torch.nn.Module], object] | None = None
) -> int:
    """Bytes of the model's parameters, from a build on the meta device that `prepare` gives
    their served precision (model_build.prepare_on_meta: block-FP8 layers and experts, the
    MTP head), not the 16-bit build dtype."""
    with torch.device("meta"):
        model = cls(model_config)
        if prepare is not None:
            prepare(model)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def size_hybrid_slots(
    cap: int,
    free_bytes: int,
    weight_bytes: int,
    fraction: float,
    state_per_slot: int,
    kv_per_token: int,
    typical_tokens: int,
) -> BatchSizing:
    """Seq slots of a hybrid model before it is built (see the module docstring)."""
    usable = (free_bytes * (1.0 - _HYBRID_ACTIVATION_RESERVE) - weight_bytes) * fraction
    per_request = state_per_slot + typical_tokens * kv_per_token
    fits = int(usable // per_request) if usable > 0 else 0
    detail = (
        f"{fits} requests of {typical_tokens} tokens fit in {usable / 2**30:.1f} GiB "
        f"({state_per_slot / 2**20:.1f} MiB recurrent state + "
        f"{typical_tokens * kv_per_token / 2**20:.1f} MiB KV each)"
    )
    if fits < 1:
        raise RuntimeError(
            f"not enough GPU memory for one request's recurrent state and KV: {detail}; "
            f"lower max_seq_len or set max_batch_size"
        )
    if fits >= cap:
        return BatchSizing(cap, "cap", detail)
    return BatchSizing(fits, "recurrent state", detail)


def size_from_kv(
    cap: int, num_blocks: int, tokens_per_block: int, typical_tokens: int
) -> BatchSizing:
    """Seq slots a dense model gets from its sized KV cache."""
    kv_tokens = num_blocks * tokens_per_block
    fits = max(1, kv_tokens // typical_tokens)
    detail = f"the KV cache holds {kv_tokens} tokens = {fits} requests of {typical_tokens}"
    if fits >= cap:
        return BatchSizing(cap, "cap", detail)
    return BatchSizing(fits, "kv cache", detail)


@dataclass(frozen=True)
class SeqLenSizing:
    """The final max_seq_len, the bound that set it, and how to change it."""

    max_seq_len: int
    bound: str  # "max_seq_len" (the user's), "max_position_embeddings", "kv cache", ...
    detail: str

    def describe(self) -> str:
        return f"max_seq_len {self.max_seq_len} (bound: {self.bound}); {self.detail}"


def cap_max_seq_len(
    configured: int,
    source: str,
    kv_tokens: int,
    memory_fraction: float,
    config_max_position_embeddings: int | None,
) -> SeqLenSizing:
    """The final max_seq_len: a default (`source` is not MAX_SEQ_LEN_USER) capped by the
    tokens the sized KV cache holds; the user's value as given (startup checked it fits).

    NOTE: a request of the capped length takes the whole cache: the scheduler preempts the
    others as it grows (scheduler.py), so the limit is reachable, just not concurrently.
    """
    mpe = config_max_position_embeddings
    if source == MAX_SEQ_LEN_USER:
        return SeqLenSizing(configured, "max_seq_len", f"given (max_position_embeddings {mpe})")
    if kv_tokens < configured:
        return SeqLenSizing(
            kv_tokens,
            "kv cache",
            f"the KV cache holds {kv_tokens} tokens, fewer than the checkpoint's {configured} "
            f"({source}); for more raise kv_cache_free_gpu_memory_fraction (now "
            f"{memory_fraction}) or kv_cache_max_tokens; set max_seq_len= for a fixed value",
        )
    reasons = {
        MAX_SEQ_LEN_CONFIG: f"the checkpoint's context length (the KV cache holds {kv_tokens} "
        "tokens)",
        MAX_SEQ_LEN_CPU_CAP: f"max_position_embeddings {mpe} capped on the CPU, whose KV cache "
        "is a full batch at max_seq_len",
        MAX_SEQ_LEN_FALLBACK: "the checkpoint's config gives no max_position_embeddings",
    }
    detail = f"{reasons.get(source, source)}; set max_seq_len= to change it"
    return SeqLenSizing(configured, source, detail)
