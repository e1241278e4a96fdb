"""Capacity probe and KV-cache sizing.

Before the KV cache is sized from free memory, a text-only dummy request AND a multimodal dummy
request go through the real engine path (device moves, seq-slot delta cache, vision tower, one
decode step). Upstream's Qwen3.6 startup crash happened exactly in such a probe, so a route that
cannot serve text-only or multimodal requests fails here, at startup, with the real error.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import kv_heads_per_rank
from .llm_request import LlmRequest
from .model_engine import PyTorchModelEngine
from .resource_manager import KVCacheManager, SeqSlotManager
from .scheduler import ScheduledRequests

logger = logging.getLogger(__name__)

_PROBE_REQUEST_ID_BASE = -1_000_000


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV cache of a model (attention layers only)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_text_config(
        cls, text_config: Any, dtype: torch.dtype, tp_size: int = 1
    ) -> KVCacheSpec:
        """`tp_size`: the cache of one tensor-parallel rank (its kv heads only)."""
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        layer_types = getattr(text_config, "layer_types", None) or []
        num_layers = sum(1 for t in layer_types if t == "full_attention") or (
            text_config.num_hidden_layers
        )
        num_kv_heads = kv_heads_per_rank(text_config.num_key_value_heads, tp_size)
        return cls(num_layers, num_kv_heads, head_dim, dtype)

    def make_manager(
        self,
        tokens_per_block: int,
        num_blocks: int,
        max_blocks_per_seq: int,
        device: torch.device,
        enable_block_reuse: bool = False,
    ) -> KVCacheManager:
        return KVCacheManager(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            tokens_per_block,
            num_blocks,
            max_blocks_per_seq,
            dtype=self.dtype,
            device=device,
            enable_block_reuse=enable_block_reuse,
        )


def kv_bytes_per_token(spec: KVCacheSpec) -> int:
    """Device bytes one cached token costs over every attention layer (K and V)."""
    return KVCacheManager.bytes_per_block(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, 1, spec.dtype
    )


def _run_dummy(
    engine: PyTorchModelEngine,
    kv: KVCacheManager,
    slots: SeqSlotManager,
    request: LlmRequest,
) -> None:
    """Prefill (in max_num_tokens chunks) plus one decode step of one dummy request."""
    request.seq_slot = slots.acquire(request.request_id)
    if not kv.add_tokens(request.request_id, request.prompt_len + 1):
        raise RuntimeError("the probe KV cache is too small for the dummy request")
    try:
        while request.is_context_init:
            request.context_chunk_size = min(
                request.context_remaining_length, engine.max_num_tokens
            )
            last = request.is_last_context_chunk
            engine.forward(ScheduledRequests(context_requests=[request], generation_requests=[]))
            if last:
                request.add_new_token(0)
            else:
                request.move_to_next_context_chunk()
        engine.forward(ScheduledRequests(context_requests=[], generation_requests=[request]))
    finally:
        kv.free(request.request_id)
        slots.release(request.request_id)


def run_capacity_probe(
    engine: PyTorchModelEngine,
    spec: KVCacheSpec,
    dummy_requests: list[tuple[list[int], Any]],
    tokens_per_block: int,
) -> int:
    """Run each dummy (prompt ids, multimodal params) through the engine; returns peak bytes."""
    device = engine.device
    longest = max(len(ids) for ids, _ in dummy_requests) + 2
    blocks_per_seq = -(-longest // tokens_per_block)
    kv = spec.make_manager(tokens_per_block, blocks_per_seq, blocks_per_seq, device)
    slots = SeqSlotManager(engine.max_batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    engine.set_kv_cache_manager(kv)
    try:
        for i, (ids, params) in enumerate(dummy_requests):
            req = LlmRequest(_PROBE_REQUEST_ID_BASE - i, ids, multimodal_params=params)
            _run_dummy(engine, kv, slots, req)
    finally:
        engine.set_kv_cache_manager(None)
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def device_free_bytes(device: torch.device) -> int | None:
    """Device memory free now, for the KV cache's share; None off CUDA (no separate pool).

    NOTE: memory freed by the probe (or by an engine shut down earlier in this process) sits in
    the caching allocator, invisible to mem_get_info: collected and emptied first. The one place
    every sizing reads free memory from (a test fakes it per tensor-parallel rank)."""
    if device.type != "cuda":
        return None
    gc.collect()  # engines shut down earlier may sit in reference cycles
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def blocks_that_fit(
    spec: KVCacheSpec,
    free_bytes: int,
    tokens_per_block: int,
    free_memory_fraction: float,
    activation_peak_bytes: int = 0,
) -> int:
    """`free_memory_fraction` of what `free_bytes` leaves after the activation peak, in blocks."""
    per_block = KVCacheManager.bytes_per_block(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, tokens_per_block, spec.dtype
    )
    left = max(0, free_bytes - activation_peak_bytes)
    return int(left * free_memory_fraction) // per_block


def choose_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    tokens_per_block: int,
    max_batch_size: int,
    max_blocks_per_seq: int,
    free_memory_fraction: float,
    max_tokens: int | None,
    activation_peak_bytes: int = 0,
    seq_len_capped_after: bool = False,
) -> int:
    """Blocks to allocate; `max_tokens` (kv_cache_max_tokens) caps the result either way.

    CUDA: `free_memory_fraction` of the memory left after the weights and the probe's activation
    peak (`activation_peak_bytes` above the steady allocation), as upstream does; the default
    batch size then follows from it (capacity.py). CPU: a full batch at max_seq_len (there is
    no separate device pool to size).
    `seq_len_capped_after`: max_seq_len is a default that the caller caps to the blocks chosen
    here (`capacity.cap_max_seq_len`), so fewer than `max_blocks_per_seq` blocks is no error.
    A tensor-parallel engine then takes the minimum over its ranks (`tp_setup.agree_num_blocks`).
    """
    cap = None if max_tokens is None else max(1, -(-max_tokens // tokens_per_block))
    free = device_free_bytes(device)
    if free is None:
        wanted = max_batch_size * max_blocks_per_seq
        return wanted if cap is None else min(wanted, cap)
    budget = blocks_that_fit(
        spec, free, tokens_per_block, free_memory_fraction, activation_peak_bytes
    )
    check_blocks_fit(budget, max_blocks_per_seq, seq_len_capped_after)
    return budget if cap is None else min(budget, cap)


def check_blocks_fit(
    budget: int, max_blocks_per_seq: int, seq_len_capped_after: bool, where: str = ""
) -> None:
    """A RuntimeError when `budget` blocks cannot hold one max_seq_len sequence (or any, when
    max_seq_len is capped to the cache afterwards)."""
    if budget < (1 if seq_len_capped_after else max_blocks_per_seq):
        raise RuntimeError(
            f"not enough GPU memory for one max_seq_len sequence{where}: {budget} KV blocks "
            f"fit, {max_blocks_per_seq} needed; lower max_seq_len or raise the memory fraction"
        )


def kv_tokens_upper_bound(
    spec: KVCacheSpec,
    device: torch.device,
    free_memory_fraction: float,
    max_tokens: int | None,
) -> int | None:
    """Most tokens the KV cache could get from the memory free now (None off CUDA): a bound
    of what `choose_num_blocks` gives later, since the probe only takes memory away.

    Bounds the block-table width of an engine whose max_seq_len is a default still to be
    capped, so a huge max_position_embeddings never sizes tables for tokens that cannot fit.
    """
    free = device_free_bytes(device)  # as choose_num_blocks reads it: never below its figure
    if free is None:
        return None
    tokens = int(free * free_memory_fraction) // max(1, kv_bytes_per_token(spec))
    return tokens if max_tokens is None else min(tokens, max_tokens)
