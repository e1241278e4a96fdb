"""The split points of piecewise CUDA graphs: the decoder's attention calls.

Prefill and mixed steps cannot be captured whole: the prefill attention's grid and its host
metadata depend on the step's sequences. Everything else in a decoder layer (norms, projections,
rope, MLP) only depends on the token count. So the text stack's attention modules call their
backend through `run_attention`, and a graph runner (`pyexecutor/piecewise_graph_runner.py`)
can take those calls over with `attention_handler` while it warms up and captures: it ends the
current graph at each call, hands the model a static output buffer, and at replay runs the
attention itself, eagerly, between the graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .interface import AttentionMetadata

AttentionHandler = Callable[
    [Any, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor
]
# One engine runs one model forward at a time, so a module-level handler is enough.
_handler: AttentionHandler | None = None


def run_attention(
    backend: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_metadata: AttentionMetadata,
) -> torch.Tensor:
    """`backend.forward(q, k, v, attn_metadata)`, or the active handler's answer."""
    if _handler is None:
        return backend.forward(q, k, v, attn_metadata)
    return _handler(backend, q, k, v, attn_metadata)


@contextmanager
def attention_handler(handler: AttentionHandler) -> Iterator[None]:
    """Route every `run_attention` call to `handler(backend, q, k, v, metadata)` inside."""
    global _handler
    if _handler is not None:
        raise RuntimeError("an attention handler is already active")
    _handler = handler
    try:
        yield
    finally:
        _handler = None
