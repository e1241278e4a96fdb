"""Triton kernels with torch fallbacks, and the backend choice they share.

- `mrope.py`: in-place (m)RoPE of q and k with the cos/sin table lookup fused in.
- `pos_embed_interp.py`: Qwen3-VL position-embedding bilinear resampling in merge-window order.
- `fused_moe.py`: grouped-GEMM MoE (SwiGLU experts) over a padded expert-sorted layout;
  `moe_routing.py` (softmax/top-k routing and the layout), `moe_tiles.py`, `moe_gemv.py`.

Every public entry point takes `backend: "auto" | "triton" | "torch"`. "auto" uses Triton for
CUDA tensors and torch elsewhere. When Triton is missing on a CUDA tensor, "auto" warns once and
takes the torch path; "triton" raises instead. CPU tensors reach the kernels only with
`TRITON_INTERPRET=1` (the tests), which must be set before triton is first imported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

_LOG = logging.getLogger(__name__)
BACKENDS = ("auto", "triton", "torch")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # The torch paths still work; kernels are defined as plain functions.
    triton = None
    tl = None
    HAS_TRITON = False

_warned: set[str] = set()

# Programmatic dependent launch (Hopper and later) for the kernels of a decode step: each kernel
# is launched while its predecessor still runs, waits for it at its first instruction
# (`pdl_sync`) and at once lets its own successor launch, so the launch latency between two
# kernels of a graph replay overlaps the predecessor's tail. For every launch it shortened
# decode steps by 2-5% on the H200 but lengthened prefill, where the early successors of kernels
# with thousands of programs hold SM slots while they wait (run 11 in
# benchmarks/results/qwen3_vl_8b_h200.md). So only launches of at most `_PDL_MAX_PROGRAMS`
# programs use it (every decode-step kernel up to batch 128 stays below; an 8k-token prefill's
# are far above). Gated that way it costs prefill nothing and halves the idle time inside a
# decode graph replay (run 14), so it is on by default; TRTLLM_PDL=0 turns it off.
PDL_REQUESTED = os.environ.get("TRTLLM_PDL", "1") != "0"
_PDL_MAX_PROGRAMS = 2048
_pdl_devices: dict[int, bool] = {}


def pdl_launch_kwargs(device: torch.device, programs: int) -> dict[str, bool]:
    """The launch keywords of a `pdl_sync` kernel with `programs` programs in its grid:
    `USE_PDL` (constexpr) and Triton's `launch_pdl` option, on for CUDA devices of compute
    capability 9.0+ when requested and the grid is decode-sized."""
    if not PDL_REQUESTED or device.type != "cuda" or not HAS_TRITON:
        return {"USE_PDL": False}
    if programs > _PDL_MAX_PROGRAMS:
        return {"USE_PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = _pdl_devices.get(index)
    if capable is None:
        capable = _pdl_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return {"USE_PDL": True, "launch_pdl": True} if capable else {"USE_PDL": False}


def triton_jit(
    fn: Callable[..., Any] | None = None, *, do_not_specialize: tuple[str, ...] = ()
) -> Any:
    """`triton.jit` when Triton is importable; else the function itself (never launched).

    `do_not_specialize` names integer arguments that change from step to step (row counts,
    offsets). Triton otherwise compiles a new variant when such a value turns 1 or a multiple
    of 16, and a compile in the middle of serving stalls every request for ~0.3 s.
    """

    def wrap(f: Callable[..., Any]) -> Any:
        if not HAS_TRITON:
            return f
        return triton.jit(f, do_not_specialize=list(do_not_specialize))

    return wrap if fn is None else wrap(fn)


if HAS_TRITON:

    @triton.jit
    def pdl_sync(USE_PDL: tl.constexpr):
        # Before any global memory access: wait until the predecessor kernel has finished and
        # its writes are visible (so no read-after-write or write-after-read race), then allow
        # the successor to launch; it waits here in turn.
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

else:

    def pdl_sync(USE_PDL: bool) -> None:
        """Placeholder without Triton (the kernels are never launched then)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(name: str, device: torch.device, backend: str) -> bool:
    """Decide whether kernel `name` runs on Triton for tensors on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError(f"{name}: backend='triton' requested but triton is not installed")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"{name}: backend='triton' on a {device.type} tensor needs TRITON_INTERPRET=1"
            )
        return True
    if device.type != "cuda":
        return False
    if not HAS_TRITON:
        if name not in _warned:
            _warned.add(name)
            _LOG.warning("%s: triton is not installed; using the slower torch path on CUDA", name)
        return False
    return True
