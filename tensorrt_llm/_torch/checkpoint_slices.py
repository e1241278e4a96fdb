"""Lazy safetensors tensors: a tensor-parallel rank reads only its shard of each weight.

`lazy_safetensors_checkpoint(dir)` maps every weight name to a `LazyTensor` (shape and dtype
from the header, nothing read yet). `TensorShard.take(lazy)` indexes it through safetensors'
`get_slice`, which reads just the rows (or columns) asked for from the memory-mapped file;
`materialize()` / `.to(...)` read the whole tensor (replicated weights, the vision tower).
`RowGather` is a checkpoint tensor's rows in another order (Qwen3-Next's grouped DeltaNet
projections seen in the contiguous layout): a slice of it reads only the source rows it maps to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

# safetensors' dtype names -> torch
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class LazyTensor:
    """One checkpoint tensor, read on demand (whole or a slice)."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self.name = name
        view = handle.get_slice(name)
        self.shape = torch.Size(view.get_shape())
        dtype = view.get_dtype()
        if dtype not in _DTYPES:
            raise ValueError(f"checkpoint tensor {name!r} has unsupported dtype {dtype}")
        self.dtype = _DTYPES[dtype]

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Only the indexed part is read (basic slices)."""
        part: torch.Tensor = self._handle.get_slice(self.name)[index]
        return part

    def materialize(self) -> torch.Tensor:
        tensor: torch.Tensor = self._handle.get_tensor(self.name)
        return tensor

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.materialize().to(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


class RowGather:
    """Rows of `source` (a tensor or a `LazyTensor`) taken as `(start, length)` ranges and
    joined in order, read on demand: indexing rows `[a, b)` of it reads only the source
    rows those map to, so a tensor-parallel rank's shard of a regrouped layout reads only
    its part of the file."""

    def __init__(self, source: Any, ranges: tuple[tuple[int, int], ...]) -> None:
        rows = int(source.shape[0])
        for start, n in ranges:
            if start < 0 or n < 0 or start + n > rows:
                raise ValueError(f"row range [{start}, {start + n}) outside a tensor of {rows}")
        self.source = source
        self.ranges = ranges
        self.shape = torch.Size((sum(n for _, n in ranges), *source.shape[1:]))
        self.dtype: torch.dtype = source.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Basic slices only (`TensorShard.take`'s), the first one over the gathered rows."""
        index = index if isinstance(index, tuple) else (index,)
        rows, rest = (index[0], index[1:]) if index else (slice(None), ())
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise ValueError(f"RowGather takes a contiguous row slice, got {rows!r}")
        lo, hi, _ = rows.indices(self.shape[0])
        parts, offset = [], 0  # offset: the first gathered row of the current range
        for start, n in self.ranges:
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                src = (slice(start + a - offset, start + b - offset), *rest)
                part = self.source[src]
                parts.append(part if isinstance(part, torch.Tensor) else torch.as_tensor(part))
            offset += n
        if not parts:  # an empty slice keeps the trailing shape
            empty = self.source[(slice(0, 0), *rest)]
            return empty if isinstance(empty, torch.Tensor) else torch.as_tensor(empty)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def materialize(self) -> torch.Tensor:
        return self[:]

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.materialize().to(*args, **kwargs)

    def __repr__(self) -> str:
        return f"RowGather({self.source!r}, {len(self.ranges)} ranges, shape={tuple(self.shape)})"


def materialize(value: Any) -> torch.Tensor:
    """A tensor from a loaded tensor, a `LazyTensor` or a `RowGather`."""
    return value.materialize() if isinstance(value, (LazyTensor, RowGather)) else value


def lazy_safetensors_checkpoint(shards: list[Path]) -> dict[str, LazyTensor]:
    """Every tensor of the shard files, unread; the files stay memory-mapped while any of
    their `LazyTensor`s lives."""
    out: dict[str, LazyTensor] = {}
    for shard in shards:
        handle = safe_open(str(shard), framework="pt", device="cpu")
        for name in handle.keys():
            out[name] = LazyTensor(handle, name)
    return out
