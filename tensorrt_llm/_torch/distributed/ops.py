"""The collectives of the tensor-parallel modules, over the mapping's tp group.

All return their input as is at `tp_size == 1`. Under a CUDA graph the NCCL kernels are
captured with the rest of the step (they take no host-side decision per call).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...mapping import Mapping
from .process_group import tp_group


def all_reduce(x: torch.Tensor, mapping: Mapping) -> torch.Tensor:
    """Sum of `x` over the tp group, in place (the partial outputs of a row-parallel layer)."""
    if mapping.tp_size == 1:
        return x
    try:
        dist.all_reduce(x, group=tp_group(mapping))
    except RuntimeError as exc:
        raise collective_error("all_reduce", exc) from exc
    return x


def all_reduce_max(x: torch.Tensor, mapping: Mapping) -> torch.Tensor:
    """Element-wise max of `x` over the tp group, in place (a row-parallel weight's per-row
    amax, so every rank's FP8 row scale is the full row's: `quantize_model_fp8_`)."""
    if mapping.tp_size == 1:
        return x
    try:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp_group(mapping))
    except RuntimeError as exc:
        raise collective_error("all_reduce(MAX)", exc) from exc
    return x


def all_gather(x: torch.Tensor, mapping: Mapping, dim: int = -1) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim`, in rank order (vocab-parallel logits)."""
    if mapping.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(mapping.tp_size)]
    try:
        dist.all_gather(parts, x, group=tp_group(mapping))
    except RuntimeError as exc:
        raise collective_error("all_gather", exc) from exc
    return torch.cat(parts, dim=dim)


def min_over_ranks(values: Sequence[int], mapping: Mapping, device: torch.device) -> list[int]:
    """The element-wise minimum of `values` over the tp group (sizes every rank must agree on
    before allocating: a KV block count each rank derived from its own free memory)."""
    if mapping.tp_size == 1:
        return list(values)
    # gloo reduces host tensors, NCCL device ones.
    wire = device if device.type == "cuda" else torch.device("cpu")
    x = torch.tensor(list(values), dtype=torch.int64, device=wire)
    try:
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=tp_group(mapping))
    except RuntimeError as exc:
        raise collective_error("all_reduce(MIN)", exc) from exc
    return [int(v) for v in x.tolist()]


def collective_error(op: str, exc: BaseException) -> RuntimeError:
    """The error a step fails with when a collective does (typically: a rank died; the
    engine process's watcher then stops the engine)."""
    return RuntimeError(f"tensor-parallel {op} failed (a rank may be gone): {exc}")
