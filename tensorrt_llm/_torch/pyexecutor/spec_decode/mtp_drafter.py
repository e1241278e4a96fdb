"""MTPDrafter: the next k draft tokens of each request from the checkpoint's MTP head.

Position i of the head takes the target's final-normed hidden state h_i and the embedding of
token i + 1, and predicts token i + 2 (`modeling_qwen3_5_mtp.py`). Its attention has its own
KV layers, so every position of a sequence must pass through it once:

- pass 1 (one chunk per request): the positions this step's target forward covered (a prompt
  chunk, or a verify row's accepted part), with the tokens that followed them: the prompt's,
  then the sampled token, or the accepted drafts and the bonus token. Its last row gives draft 1.
- passes 2..k (one token per request): the previous pass's MTP hidden state and the embedding
  of the previous draft, one position further. Their KV writes lie past the accepted tokens
  and are overwritten when the next step's pass 1 covers those positions.

Drafts stay on the device between passes; the host gets them with one copy at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...._utils import async_tensor_h2d
from ...attention_backend.interface import AttentionMetadata

if TYPE_CHECKING:
    from ...models.modeling_qwen3_next import Qwen3_5TextForCausalLM
    from ..llm_request import LlmRequest
    from ..resource_manager import KVCacheManager


@dataclass
class DraftRow:
    """One request's pass-1 chunk: rows [offset, offset + len(next_ids)) of the step's hidden
    states, at KV positions start.., followed by `next_ids`; `num_drafts` tokens wanted."""

    request: LlmRequest
    offset: int
    start: int
    next_ids: list[int]
    num_drafts: int


class MTPDrafter:
    def __init__(
        self,
        lm: Qwen3_5TextForCausalLM,
        kv_cache_manager: KVCacheManager,
        tokens_per_block: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        if lm.mtp is None:
            raise ValueError("MTP drafting needs a model built with its MTP head (with_mtp)")
        self.lm = lm
        self.mtp = lm.mtp
        self.kv_cache_manager = kv_cache_manager
        self.tokens_per_block = tokens_per_block
        self.vocab_size = vocab_size
        self.device = device

    def _metadata(
        self, requests: Sequence[LlmRequest], starts: Sequence[int], lens: Sequence[int]
    ) -> AttentionMetadata:
        """Chunk rows (`num_cached_tokens = start`) over the requests' own KV blocks."""
        tpb = self.tokens_per_block
        seq_lens = np.asarray(lens, dtype=np.int32)
        cached = np.asarray(starts, dtype=np.int32)
        cu = np.zeros(len(requests) + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=cu[1:])
        blocks = [self.kv_cache_manager.get_block_array(r.request_id) for r in requests]
        width = max(b.shape[0] for b in blocks)
        table = np.full((len(requests), width), -1, dtype=np.int32)
        slot_parts = []
        for i, (b, start, n) in enumerate(zip(blocks, starts, lens, strict=True)):
            table[i, : b.shape[0]] = b
            tok = np.arange(start, start + n)
            # Past the request's claimed blocks (drafts beyond its last token): not written.
            inside = tok // tpb < b.shape[0]
            slots = np.full(n, -1, dtype=np.int64)
            slots[inside] = b[tok[inside] // tpb].astype(np.int64) * tpb + tok[inside] % tpb
            slot_parts.append(slots)
        seq_slots = np.asarray([r.seq_slot for r in requests], dtype=np.int64)
        dev = self.device

        def h2d(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return async_tensor_h2d(torch.from_numpy(a), dtype, dev)

        return AttentionMetadata(
            num_contexts=len(requests),
            num_generations=0,
            num_ctx_tokens=int(seq_lens.sum()),
            num_tokens=int(seq_lens.sum()),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            num_cached_tokens_cpu=torch.from_numpy(cached),
            seq_lens=h2d(seq_lens, torch.int32),
            num_cached_tokens=h2d(cached, torch.int32),
            cu_seqlens_q=h2d(cu, torch.int32),
            block_tables=h2d(table, torch.int32),
            slot_mapping=h2d(np.concatenate(slot_parts), torch.int64),
            seq_slots=h2d(seq_slots, torch.int64),
            seq_slots_cpu=torch.from_numpy(seq_slots),
            kv_cache_manager=self.kv_cache_manager,
            tokens_per_block=tpb,
        )

    def _step(
        self,
        md: AttentionMetadata,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        step: int,
        last: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP pass -> (its hidden states at `last` rows, their greedy draft tokens)."""
        cos_sin = self.lm.model.get_cos_sin(positions)
        out = self.mtp(embeds, hidden, cos_sin, md, step)
        out_last = out.index_select(0, last)
        logits = self.lm.lm_logits(out_last)[:, : self.vocab_size]
        return out_last, logits.argmax(dim=-1)

    @torch.inference_mode()
    def draft(
        self, rows: Sequence[DraftRow], hidden: torch.Tensor, position_ids: torch.Tensor
    ) -> list[list[int]]:
        """Drafts of each row (`num_drafts` tokens; [] for 0) from the step's final-normed
        `hidden: [T, H]` and `position_ids` (`[3, 1, T]` or `[1, T]`, deltas applied)."""
        if not rows:
            return []
        dev = hidden.device
        index = np.concatenate([np.arange(r.offset, r.offset + len(r.next_ids)) for r in rows])
        index_t = async_tensor_h2d(torch.from_numpy(index), torch.int64, dev)
        lens = [len(r.next_ids) for r in rows]
        last = async_tensor_h2d(torch.from_numpy(np.cumsum(lens) - 1), torch.int64, dev)
        next_ids = async_tensor_h2d([t for r in rows for t in r.next_ids], torch.int64, dev)
        embed = self.lm.model.embed_tokens
        positions = position_ids.index_select(-1, index_t)
        md = self._metadata([r.request for r in rows], [r.start for r in rows], lens)
        state, token = self._step(
            md, embed(next_ids), hidden.index_select(0, index_t), positions, 0, last
        )
        pos = positions.index_select(-1, last)  # each row's last position
        drafts = [token]
        live = list(range(len(rows)))  # rows still drafting, indices into `rows`
        ends = [r.start + n - 1 for r, n in zip(rows, lens, strict=True)]
        for step in range(1, max(r.num_drafts for r in rows)):
            keep = [j for j, i in enumerate(live) if rows[i].num_drafts > step]
            if len(keep) < len(live):
                sel = async_tensor_h2d(keep, torch.int64, dev)
                state, token, pos = state[sel], token[sel], pos.index_select(-1, sel)
                live = [live[j] for j in keep]
            pos = pos + 1
            reqs = [rows[i].request for i in live]
            md = self._metadata(reqs, [ends[i] + step for i in live], [1] * len(live))
            rows_t = torch.arange(len(live), device=dev)
            state, token = self._step(md, embed(token), state, pos, step, rows_t)
            drafts.append(self._scatter(token, live, len(rows), dev))
        table = torch.stack(drafts, dim=1).tolist()  # the one copy of every draft
        return [table[i][: r.num_drafts] for i, r in enumerate(rows)]

    @staticmethod
    def _scatter(
        token: torch.Tensor, live: list[int], num_rows: int, dev: torch.device
    ) -> torch.Tensor:
        """`token` of the live rows placed at their row of a [num_rows] tensor (-1 elsewhere)."""
        out = torch.full((num_rows,), -1, dtype=torch.int64, device=dev)
        out.index_copy_(0, async_tensor_h2d(live, torch.int64, dev), token)
        return out
