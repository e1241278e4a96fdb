"""Token embedding and the LM head (optionally tied to the embedding).

Tensor parallelism splits both by vocabulary rows (`vocab_shard`: ceil(V / tp) rows a rank,
the last one zero-padded): the embedding looks up the ids its rank holds and all-reduces the
rows; the LM head all-gathers the ranks' logit columns and drops the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...mapping import Mapping
from ..distributed import all_gather, all_reduce, vocab_shard
from .tensor_parallel import ParamShards


def _vocab_rows(vocab_size: int, mapping: Mapping) -> tuple[int, int, ParamShards]:
    """(first vocab id this rank holds, rows of its weight, checkpoint slices)."""
    if not mapping.has_tp:
        return 0, vocab_size, {}
    shard = vocab_shard(vocab_size, mapping.tp_size, mapping.tp_rank)
    return shard.start, shard.size, {"weight": (shard,)}


class Embedding(nn.Module):
    """Token id -> vector lookup. `weight: [num_embeddings, embedding_dim]` (this rank's
    vocabulary rows under tensor parallelism)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        mapping: Mapping | None = None,
    ):
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"Embedding sizes must be positive: {num_embeddings}x{embedding_dim}")
        self.mapping = mapping if mapping is not None else Mapping()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start, rows, self.tp_shards = _vocab_rows(num_embeddings, self.mapping)
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_shards:
            return self._forward_vocab_parallel(input_ids)
        return F.embedding(input_ids, self.weight)

    def _forward_vocab_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Ids outside this rank's rows (padding rows included) look up row 0 and are zeroed:
        # exactly one rank contributes each token's vector to the sum.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.mapping)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """Hidden -> vocab logits. `weight: [vocab_size, hidden_size]`, no bias (this rank's
    vocabulary rows under tensor parallelism; the output is always the full vocabulary).

    `tie_to(embedding)` shares the embedding's Parameter object, so loading either name fills
    both and the materialisation on load keeps them one tensor.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        mapping: Mapping | None = None,
    ):
        super().__init__()
        if vocab_size <= 0 or hidden_size <= 0:
            raise ValueError(f"LMHead sizes must be positive: {vocab_size}x{hidden_size}")
        self.mapping = mapping if mapping is not None else Mapping()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        _, rows, self.tp_shards = _vocab_rows(vocab_size, self.mapping)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype))

    def tie_to(self, embedding: Embedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie LMHead {tuple(self.weight.shape)} to embedding "
                f"{tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if not self.tp_shards:
            return logits
        return all_gather(logits, self.mapping, dim=-1)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}"
