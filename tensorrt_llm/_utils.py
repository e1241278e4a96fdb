"""Host/device copy helpers: pinned staging so copies never block the host until asked."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def prefer_pinned() -> bool:
    """True when pinned host memory is worth using (a CUDA device is present)."""
    return torch.cuda.is_available()


def maybe_pin_memory(t: torch.Tensor) -> torch.Tensor:
    """Pin a CPU tensor when CUDA exists; a no-op for device or already pinned tensors."""
    if not prefer_pinned() or t.device.type != "cpu" or t.is_pinned():
        return t
    return t.pin_memory()


def async_tensor_h2d(
    data: Sequence[int | float] | Sequence[Sequence[int | float]] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Build `data` on the host in pinned memory and copy it to `device` with non_blocking.

    NOTE: the pinned staging tensor must outlive the copy; the caching host allocator keeps
    it alive until the copy's stream event completes, so returning only the device tensor is safe.
    """
    if isinstance(data, torch.Tensor):
        host = data.to(dtype=dtype)
    else:
        host = torch.tensor(data, dtype=dtype)
    if torch.device(device).type == "cpu":
        return host
    return maybe_pin_memory(host).to(device, non_blocking=True)


def async_tensor_d2h(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue a copy of device tensor `t` into pinned host memory; returns `(host, done)`.

    `host` is valid once `done` (recorded after the copy on the current stream) has completed;
    `done` is None for a CPU `t`, whose copy is already finished.
    """
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=prefer_pinned())
    host.copy_(t, non_blocking=True)
    if not t.is_cuda:
        return host, None
    done = torch.cuda.Event()
    done.record()
    return host, done


# Open `keeping_constants` scopes, innermost last (CUDA graph capture).
_keepers: list[list[torch.Tensor]] = []


@contextmanager
def keeping_constants() -> Iterator[list[torch.Tensor]]:
    """Collect every cached device constant handed out inside the scope (`kept`). A CUDA graph
    reads such a tensor by address at each replay, while the cache that made it may drop it
    (and the allocator reuse its memory) when other steps' values push it out: whoever
    captures keeps the list for as long as the graph lives."""
    kept_here: list[torch.Tensor] = []
    _keepers.append(kept_here)
    try:
        yield kept_here
    finally:
        _keepers.pop()


def kept(t: torch.Tensor) -> torch.Tensor:
    """`t`, also held by the innermost `keeping_constants` scope when one is open."""
    if _keepers:
        _keepers[-1].append(t)
    return t


def step_constant(
    values: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a tensor on `device`, built and copied once and then shared.

    Every layer of a step passes the same host lengths, offsets or flags; asking here instead
    of calling `async_tensor_h2d` per layer turns one copy per layer into one per step, and
    hands kernels with per-tensor caches (fla) the same object each time. The result is
    shared: never write to it.
    """
    return kept(_cached_constant(values, dtype, device))


@lru_cache(maxsize=32)
def _cached_constant(
    values: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return async_tensor_h2d(list(values), dtype, device)


def foreach_copy_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """`dst.copy_(src)` for each pair, one `torch._foreach_copy_` per dtype: CUDA's fused
    multi-tensor copy takes only lists of one dtype and falls back to a copy (a memcpy
    launch) per tensor otherwise, e.g. for a hybrid model's 16-bit conv rows next to its
    float32 SSM rows."""
    if len(dsts) != len(srcs):
        raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources")
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]]
    groups = {}
    for dst, src in zip(dsts, srcs, strict=True):
        pair = groups.setdefault((dst.dtype, src.dtype), ([], []))
        pair[0].append(dst)
        pair[1].append(src)
    for group_dsts, group_srcs in groups.values():
        torch._foreach_copy_(group_dsts, group_srcs)
