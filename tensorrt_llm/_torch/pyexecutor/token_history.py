"""TokenHistory: what each penalised request has generated so far, kept on the device.

Penalties need per-token counts of a request's output (and, for the repetition penalty, which
tokens its prompt holds); multi-token bad words need its last few tokens. Rebuilding those from
host lists every step would cost a [B, V] H2D, and with the overlap scheduler the newest token
is not on the host yet anyway. So the history is device state that the sampler updates from the
token tensor it just sampled (`record`), in stream order, without a sync.

Layout: one row per tracked request (by request id, not seq slot: only requests that use these
features take rows, so a server with none of them holds nothing). `codes` [capacity, V] int32
holds `2 * output_count + prompt_bit` per token, so one gather gives both the counts and the
seen-mask; `tail` [capacity, tail_len] int64 holds the last `tail_len` output tokens (-1: none
yet), right-aligned. Both are allocated lazily, grow by doubling, and are dropped when the last
tracked request is released. A row is reset when a request takes it (at its first sample, after
its whole prompt), so a row freed while the overlap scheduler's extra step still writes to it is
clean for its next owner: that write comes earlier in stream order.

Cost: 4 bytes per vocab entry per concurrently tracked request (about 0.6 MB for a 152k vocab),
allocated after the KV cache was sized from free memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..._utils import async_tensor_h2d
from ...sampling_params import SamplingParams
from .llm_request import LlmRequest

_MIN_CAPACITY = 8
NO_TOKEN = -1  # a tail entry before the request's first output token


def tail_len(params: SamplingParams) -> int:
    """How many past output tokens the request's bad words look at (their longest prefix)."""
    return max((len(seq) - 1 for seq in params.bad_words_token_ids or ()), default=0)


def is_tracked(params: SamplingParams) -> bool:
    """True when the request needs device history (a penalty, or a multi-token bad word)."""
    return params.uses_penalties or tail_len(params) > 0


class TokenHistory:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = 0
        self.codes: torch.Tensor | None = None  # [capacity, V] int32, when a penalty is used
        self.tail: torch.Tensor | None = None  # [capacity, tail_len] int64, for bad words
        self._rows: dict[int, int] = {}  # request id -> row
        self._free: list[int] = []

    @property
    def num_tracked(self) -> int:
        return len(self._rows)

    @property
    def tail_len(self) -> int:
        return 0 if self.tail is None else self.tail.shape[1]

    def rows(self, requests: Sequence[LlmRequest]) -> list[int]:
        """The history row of each request (tracked ones), taking and resetting rows for the
        requests seen for the first time (one batched reset for the step)."""
        out: list[int] = []
        new: list[tuple[LlmRequest, int]] = []
        for req in requests:
            row = self._rows.get(req.request_id)
            if row is None:
                row = self._take_row(req.sampling_params)
                self._rows[req.request_id] = row
                new.append((req, row))
            out.append(row)
        if new:
            self._reset_rows(new)
        return out

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one sampled token per row (`rows`, `tokens`: [n] int64 on the device)."""
        if self.codes is not None:
            two = torch.full_like(tokens, 2, dtype=torch.int32)
            self.codes.index_put_((rows, tokens), two, accumulate=True)
        if self.tail is not None:
            recent = self.tail.index_select(0, rows)
            shifted = torch.cat([recent[:, 1:], tokens.unsqueeze(1)], dim=1)
            self.tail.index_copy_(0, rows, shifted)

    def release(self, request_id: int) -> None:
        """Free the request's row; with no tracked request left, drop the buffers."""
        row = self._rows.pop(request_id, None)
        if row is None:
            return
        self._free.append(row)
        if not self._rows:
            self.codes = self.tail = None
            self.capacity = 0
            self._free = []

    # ---- rows and buffers ----------------------------------------------------------------------
    def _take_row(self, params: SamplingParams) -> int:
        if not self._free:
            self._grow(max(_MIN_CAPACITY, 2 * self.capacity))
        if params.uses_penalties and self.codes is None:
            self.codes = torch.zeros(
                self.capacity, self.vocab_size, dtype=torch.int32, device=self.device
            )
        need = tail_len(params)
        if need > self.tail_len:
            self.tail = self._widened_tail(need)
        return self._free.pop()

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        if self.codes is not None:
            codes = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
            codes[:old].copy_(self.codes)
            self.codes = codes
        if self.tail is not None:
            tail = torch.full(
                (capacity, self.tail.shape[1]), NO_TOKEN, dtype=torch.int64, device=self.device
            )
            tail[:old].copy_(self.tail)
            self.tail = tail
        self.capacity = capacity
        # Popped from the end: the lowest free row goes first.
        self._free.extend(range(capacity - 1, old - 1, -1))

    def _widened_tail(self, width: int) -> torch.Tensor:
        # Older entries are kept right-aligned; the new left columns read as "no token", which
        # only the longer bad words of the new request ever look at.
        tail = torch.full((self.capacity, width), NO_TOKEN, dtype=torch.int64, device=self.device)
        if self.tail is not None and self.tail.shape[1]:
            tail[:, width - self.tail.shape[1] :].copy_(self.tail)
        return tail

    def _reset_rows(self, new: list[tuple[LlmRequest, int]]) -> None:
        rows = async_tensor_h2d([row for _, row in new], torch.int64, self.device)
        if self.tail is not None:
            self.tail.index_fill_(0, rows, NO_TOKEN)
        if self.codes is None:
            return
        self.codes.index_fill_(0, rows, 0)
        # The prompt bit only matters to the repetition penalty (prompt + output).
        prompts = [(req, row) for req, row in new if req.sampling_params.repetition_penalty != 1]
        if not prompts:
            return
        ids = [np.unique(req.prompt_token_array) for req, _ in prompts]
        ids = [a[a < self.vocab_size] for a in ids]  # a stray id must not index out of range
        pairs = np.empty((2, sum(a.size for a in ids)), dtype=np.int64)
        pairs[0] = np.repeat([row for _, row in prompts], [a.size for a in ids])
        pairs[1] = np.concatenate(ids)
        dev_pairs = async_tensor_h2d(torch.from_numpy(pairs), torch.int64, self.device)
        ones = torch.ones(pairs.shape[1], dtype=torch.int32, device=self.device)
        self.codes.index_put_((dev_pairs[0], dev_pairs[1]), ones)
