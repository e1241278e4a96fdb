"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    """Token id -> vector lookup. `weight: [num_embeddings, embedding_dim]`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"Embedding sizes must be positive: {num_embeddings}x{embedding_dim}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """Hidden -> vocab logits. `weight: [vocab_size, hidden_size]`, no bias.

    `tie_to(embedding)` shares the embedding's Parameter object, so loading either name fills
    both and the materialisation on load keeps them one tensor.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        if vocab_size <= 0 or hidden_size <= 0:
            raise ValueError(f"LMHead sizes must be positive: {vocab_size}x{hidden_size}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def tie_to(self, embedding: Embedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie LMHead {tuple(self.weight.shape)} to embedding "
                f"{tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight)

    def extra_repr(self) -> str:
        return f"{self.hidden_size} -> {self.vocab_size}"
