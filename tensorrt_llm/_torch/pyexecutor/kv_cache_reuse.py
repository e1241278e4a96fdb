"""KV block reuse (prefix caching) for requests: their block keys, the admission hit and the
registration of the blocks a step wrote.

`KVCacheManager` and `BlockPool` know blocks, not requests; this module knows which tokens of
a request are in its KV cache and what its blocks' keys are:
- keys (`block_hash.compute_block_keys`) are computed lazily and extended as the request grows,
  so each block is hashed once; a media run contributes its item's content hash, read from
  `multimodal_data["multimodal_hashes"]` (the front end's `InputPreparer` computes them).
- admission (`SimpleScheduler`) asks `match` for the cached leading blocks of the request's
  context, at most `max_reusable_blocks` (one token must still run to give logits).
- after a step is launched, `register_step` registers every full block whose KV that step (or
  an earlier one) wrote: the KV writes are queued on the one stream ahead of any later step
  that could read the block, so this is safe with the overlap executor too.

A request whose media cannot be named (precomputed embeddings, spans without hashes) takes no
part: it neither hits nor registers, so it can never be served stale KV.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from ...inputs.multimodal import MULTIMODAL_LENGTHS
from .block_hash import BlockKey, MediaSpan, compute_block_keys, max_reusable_blocks, media_spans
from .llm_request import LlmRequest

if TYPE_CHECKING:
    from .resource_manager import KVCacheManager
    from .scheduler import ScheduledRequests

logger = logging.getLogger(__name__)


def _placeholder_tokens(data: dict) -> int:
    lengths = data.get(MULTIMODAL_LENGTHS) or {}
    return sum(int(np.asarray(v).sum()) for v in lengths.values())


class KvCacheReuse:
    """The request side of prefix caching over one `KVCacheManager` (reuse on)."""

    def __init__(self, kv_cache_manager: KVCacheManager, spatial_merge_size: int = 1) -> None:
        if not kv_cache_manager.enable_block_reuse:
            raise ValueError("KvCacheReuse needs a KVCacheManager with enable_block_reuse=True")
        self.kv = kv_cache_manager
        self.tokens_per_block = kv_cache_manager.tokens_per_block
        self.spatial_merge_size = spatial_merge_size

    # ---- keys --------------------------------------------------------------------------------
    def _spans(self, req: LlmRequest) -> list[MediaSpan] | None:
        """The request's media runs with their hashes ([] for text), None when reuse must be
        off for it. Looked at once, before the first device move or strip of the media."""
        if req.reuse_media_spans is not None or req.block_reuse_off:
            return req.reuse_media_spans
        params = req.multimodal_params
        data = params.multimodal_data if params is not None else None
        spans: list[MediaSpan] | None = []
        if data:
            try:
                spans = media_spans(data, self.spatial_merge_size)
            # NOTE: any malformed payload only turns reuse off here (this runs inside the
            # scheduler); the batch builder's checks then fail the request alone.
            except Exception as exc:  # no hashes (a request built by hand), bad spans, ...
                logger.debug("request %s: no KV reuse (%s)", req.request_id, exc)
                spans = None
            pairs = zip(spans or [], (spans or [])[1:], strict=False)
            if any(b.start < a.end for a, b in pairs):
                spans = None  # overlapping runs: compute_block_keys would raise
            # Placeholder runs that no hashed item covers (precomputed embeddings) would key
            # as plain text: every image would then look the same.
            if spans is not None and sum(s.length for s in spans) != _placeholder_tokens(data):
                spans = None
        if spans is None:
            req.block_reuse_off = True
        req.reuse_media_spans = spans
        return spans

    def block_keys(self, req: LlmRequest, num_tokens: int) -> list[BlockKey]:
        """Keys of the request's full blocks within its first `num_tokens` tokens (prompt,
        then outputs), computed once each; [] when the request takes no part in reuse."""
        spans = self._spans(req)
        if spans is None:
            return []
        keys = req.block_keys
        tpb = self.tokens_per_block
        want = num_tokens // tpb
        if want > len(keys):
            tokens = _token_prefix(req, want * tpb)
            keys = compute_block_keys(tokens, tpb, spans, req.cache_salt, known=keys)
            req.block_keys = keys
        return keys[:want] if want < len(keys) else keys

    # ---- admission ---------------------------------------------------------------------------
    def match(self, req: LlmRequest) -> list[int]:
        """Cached blocks the request's context may start from (no side effects)."""
        if req.sampling_params.prompt_logprobs is not None:
            return []  # every prompt position's logits are needed: nothing may be skipped
        cap = max_reusable_blocks(req.context_len, self.tokens_per_block)
        if cap == 0:
            return []
        keys = self.block_keys(req, cap * self.tokens_per_block)
        if not keys:
            return []
        return self.kv.find_cached_prefix(keys, cap)

    def on_admitted(self, req: LlmRequest, hit_blocks: list[int]) -> None:
        """Count an admission's lookup: the first admission's is the request's reported hit
        (`num_cached_tokens`) and goes into the stats; a resume after preemption's is not."""
        hit_tokens = len(hit_blocks) * self.tokens_per_block
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit_tokens
            self.kv.prefix_cache_stats.record(req.prompt_len, hit_tokens)

    def chunk_limit(self, req: LlmRequest, remaining: int) -> int:
        """The most context tokens the request's next chunk may take out of `remaining`:
        all of them here; hybrid models end a chunk at a second snapshot point inside it."""
        return remaining

    def plan_step(self, scheduled: ScheduledRequests) -> None:
        """The step's chunks are sized (end of `schedule`): nothing to do here; hybrid models
        give the requests snapshotted inside their chunk a scratch seq slot."""

    def on_released(self, req: LlmRequest) -> None:
        """The request gave its blocks and seq slot back (finished, failed, preempted)."""

    # ---- registration ------------------------------------------------------------------------
    def register_step(self, scheduled: ScheduledRequests) -> None:
        """Register the full blocks whose KV the launched step has written (see the module
        docstring); call it once the step is launched, before its results are applied."""
        tpb = self.tokens_per_block
        for req in scheduled.context_requests:
            self._register(req, req.context_current_position + req.context_chunk_size, tpb)
        for req in scheduled.generation_requests:
            # The input token's KV is written now; a token still in flight has no host value
            # to hash yet, so only host-known tokens count.
            self._register(req, req.prompt_len + req.num_generated_tokens, tpb)

    def register_finished(self, req: LlmRequest) -> None:
        """Register what a request that stopped normally wrote, before its blocks are freed:
        with the overlap executor its last tokens reach the host after its last launch, so
        `register_step` never saw them. Every token but the last has its KV written (each was
        the input of a launched step); failed and cancelled requests are left as they are."""
        if req.finish_reason in ("stop", "length") and req.num_generated_tokens:
            written = req.prompt_len + req.num_generated_tokens - 1
            self._register(req, written, self.tokens_per_block)

    def _register(self, req: LlmRequest, written: int, tpb: int) -> None:
        if req.block_reuse_off:
            return
        full = written // tpb
        if full <= self.kv.num_registered_blocks(req.request_id):
            return  # the common decode step: no block filled up
        keys = self.block_keys(req, full * tpb)
        self.kv.register_blocks(req.request_id, keys)


def _token_prefix(req: LlmRequest, n: int) -> np.ndarray:
    """The request's first `n` tokens (prompt, then outputs) as int64."""
    context = req.context_token_array
    if n <= context.shape[0]:
        return context[:n]
    outputs = np.asarray(req.output_token_ids[: n - req.prompt_len], dtype=np.int64)
    return np.concatenate([req.prompt_token_array, outputs])
