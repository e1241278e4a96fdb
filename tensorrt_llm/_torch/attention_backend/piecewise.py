"""The split points of piecewise CUDA graphs: the decoder's token mixers (attention, DeltaNet).

Prefill and mixed steps cannot be captured whole: the prefill attention's grid and its host
metadata depend on the step's sequences, and so do the Gated DeltaNet's varlen chunk kernels and
its per-slot state pools. Everything else in a decoder layer (norms, projections, rope, MLP or
MoE) only depends on the token count. So the text stack calls each such mixer through
`run_split(op, *inputs, attn_metadata=)` (`run_attention` for attention backends), and a graph
runner (`pyexecutor/piecewise_graph_runner.py`) can take those calls over with `split_handler`
while it warms up and captures: it ends the current graph at each call, hands the model a static
output buffer, and at replay runs the op itself, eagerly, between the graphs.

A split op is any object with `forward(*inputs, attn_metadata) -> Tensor` whose output has the
width and dtype of its first input, and at most its rows: the runner's static output buffer of a
call is shaped like that input (a mixer that runs only the step's real rows leaves the padded
rows of the buffer stale, which row-wise kernels never mix into real rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .interface import AttentionMetadata

# (op, inputs, metadata) -> the op's output, or a stand-in of its shape.
SplitHandler = Callable[[Any, tuple[torch.Tensor, ...], AttentionMetadata], torch.Tensor]
# One engine runs one model forward at a time, so a module-level handler is enough.
_handler: SplitHandler | None = None


def run_split(op: Any, *inputs: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
    """`op.forward(*inputs, attn_metadata)`, or the active handler's answer."""
    if _handler is None:
        return op.forward(*inputs, attn_metadata)
    return _handler(op, inputs, attn_metadata)


def run_attention(
    backend: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_metadata: AttentionMetadata,
) -> torch.Tensor:
    """`backend.forward(q, k, v, attn_metadata)`, or the active handler's answer."""
    return run_split(backend, q, k, v, attn_metadata=attn_metadata)


@contextmanager
def split_handler(handler: SplitHandler) -> Iterator[None]:
    """Route every `run_split` call to `handler(op, inputs, metadata)` inside."""
    global _handler
    if _handler is not None:
        raise RuntimeError("a split handler is already active")
    _handler = handler
    try:
        yield
    finally:
        _handler = None
