"""Causal depthwise conv1d (Gated DeltaNet's short convolution) as Triton kernels.

Same maths as `modules/causal_conv1d.py` (its torch functions are the references): channel c of
a sequence is `act(bias[c] + sum_j w[c, j] * x[t - (W - 1) + j, c])`, the `W - 1` inputs
before the sequence start coming from its conv state `[dim, W - 1]` (zeros for a fresh one).

- `causal_conv1d_update_`: one decode token per request. Each program owns a block of channels
  of one request, so it shifts that request's conv state in place, straight in the pool row
  `slots[n]` (no gather / scatter around it), and returns the activated outputs. One launch
  replaces the torch chain (cat, mul, sum, copy, silu, casts) of a decode step.
- `causal_conv1d_varlen`: packed prefill sequences. Programs tile (token block of one sequence,
  channel block); each tap is a shifted load of the same tile (L1/L2 hits), accumulated in
  registers, so `x` is read about once and the output written once. The torch path instead
  runs a gather and a float32 `addcmul_` over the whole `[T, dim]` slab per tap (~20 ms of an
  8k-token Qwen3.6-27B prefill). Initial states are read from one tensor and final states
  written to another: a sequence's first block reads its initial state while its last block
  writes the final one, so the two must not alias. `causal_conv1d_varlen_planes` writes the
  output as three contiguous channel planes instead (q, k, v for fla's chunked kernel).
NOTE: the decode kernel has no host sync and fixed shapes, so CUDA graphs capture it.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ...._utils import async_tensor_h2d, kept
from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit

_UPDATE_BLOCK_C = 256
# Token tiles of 32: a prefill wave at Qwen3.6-35B-A3B sizes (8 sequences of 1024 tokens, x a
# strided slice of the joined in_proj output, pool rows by slot) took 273 us against 440 us
# with 64-token tiles on an H100 (`benchmarks/bench_gdn.py`, other candidates 291-1541 us).
_VARLEN_BLOCK_T = 32
_VARLEN_BLOCK_C = 128
_VARLEN_WARPS = 4


@triton_jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, slots_ptr, out_ptr,
    dim, stride_xn, stride_wc, stride_sp, stride_sc, stride_sw, stride_on,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, SILU: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < dim
    row = tl.load(slots_ptr + n).to(tl.int64) if HAS_SLOTS else n
    s_ptrs = state_ptr + row * stride_sp + offs * stride_sc
    x = tl.load(x_ptr + n * stride_xn + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    # The window is [state_0 .. state_{W-2}, x]; each entry moves one place left as it is
    # read, and only this program touches these channels of this row.
    for j in tl.static_range(WIDTH - 1):
        s = tl.load(s_ptrs + j * stride_sw, mask=mask, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + offs * stride_wc + j, mask=mask).to(tl.float32)
        if j > 0:
            tl.store(s_ptrs + (j - 1) * stride_sw, s, mask=mask)
    w_last = tl.load(w_ptr + offs * stride_wc + WIDTH - 1, mask=mask).to(tl.float32)
    acc += x.to(tl.float32) * w_last
    tl.store(s_ptrs + (WIDTH - 2) * stride_sw, x.to(state_ptr.dtype.element_ty), mask=mask)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + n * stride_on + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update_(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    states: torch.Tensor,
    slots: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per request: `x: [N, dim]` (rows may be strided, columns contiguous),
    `weight: [dim, W]`; request n's conv state is `states[slots[n]]` (`[P, dim, W - 1]`; with
    `slots` None, `states[n]`), shifted in place. Returns `[N, dim]` in x's dtype. Triton only
    (CUDA, or CPU under TRITON_INTERPRET=1); the torch path is `causal_conv1d_update`."""
    dim, width = weight.shape
    if x.dim() != 2 or x.shape[1] != dim or x.stride(1) != 1:
        raise ValueError(f"x must be [N, {dim}] with contiguous columns, got {tuple(x.shape)}")
    if states.dim() != 3 or tuple(states.shape[1:]) != (dim, width - 1):
        raise ValueError(f"states must be [P, {dim}, {width - 1}], got {tuple(states.shape)}")
    n = x.shape[0]
    if slots is not None and tuple(slots.shape) != (n,):
        raise ValueError(f"slots must be [{n}], got {tuple(slots.shape)}")
    if slots is None and states.shape[0] != n:
        raise ValueError(f"{n} tokens for {states.shape[0]} conv states")
    out = torch.empty(n, dim, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    grid = (n, triton.cdiv(dim, _UPDATE_BLOCK_C))
    _conv_update_kernel[grid](
        x, weight, bias if bias is not None else weight, states,
        slots if slots is not None else x, out,
        dim, x.stride(0), weight.stride(0), states.stride(0), states.stride(1),
        states.stride(2), out.stride(0),
        WIDTH=width, BLOCK_C=_UPDATE_BLOCK_C, HAS_BIAS=bias is not None,
        HAS_SLOTS=slots is not None, SILU=activation == "silu",
        **pdl_launch_kwargs(x.device, grid[0] * grid[1]),
    )  # fmt: skip
    return out


@triton_jit
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, has_init_ptr, final_ptr, final_rows_ptr, out_ptr,
    cu_ptr, block_seq_ptr, block_tok_ptr,
    dim, stride_xt, stride_wc, stride_in, stride_ic, stride_iw,
    stride_fp, stride_fc, stride_fw, stride_ot, num_tokens, split1, split2,
    WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_ROWS: tl.constexpr,
    SILU: tl.constexpr, PLANES: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    seq = tl.load(block_seq_ptr + blk).to(tl.int64)
    tok0 = tl.load(block_tok_ptr + blk).to(tl.int64)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    offs_t = tok0 + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mt = offs_t < end
    mc = offs_c < dim
    if HAS_INIT:
        carry = tl.load(has_init_ptr + seq) != 0
    else:
        carry = False
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + bias[None, :]
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        src = offs_t - (WIDTH - 1) + j
        m = (mt & (src >= start))[:, None] & mc[None, :]
        xv = tl.load(x_ptr + src[:, None] * stride_xt + offs_c[None, :], mask=m, other=0.0)
        w = tl.load(w_ptr + offs_c * stride_wc + j, mask=mc, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * w[None, :]
    # Only a sequence's first block reaches before its start (the carried state): the other
    # blocks skip these loads, instead of issuing them masked off for every tap.
    if HAS_INIT and carry and tok0 < start + (WIDTH - 1):
        for j in tl.static_range(WIDTH - 1):
            src = offs_t - (WIDTH - 1) + j
            # Before the sequence start: state column W - 1 + (src - start), in [0, W - 2].
            col = (WIDTH - 1) + (src - start)
            ms = (mt & (src < start))[:, None] & mc[None, :]
            s_ptrs = init_ptr + seq * stride_in + offs_c[None, :] * stride_ic
            sv = tl.load(s_ptrs + col[:, None] * stride_iw, mask=ms, other=0.0)
            w = tl.load(w_ptr + offs_c * stride_wc + j, mask=mc, other=0.0).to(tl.float32)
            acc += sv.to(tl.float32) * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    if PLANES:
        # Channels [0, split1), [split1, split2), [split2, dim) each go to their own
        # `[num_tokens, width]` plane, the planes one after another in `out`.
        lo = tl.where(offs_c < split1, 0, tl.where(offs_c < split2, split1, split2))
        hi = tl.where(offs_c < split1, split1, tl.where(offs_c < split2, split2, dim))
        plane = lo.to(tl.int64) * num_tokens + (offs_c - lo)
        o_ptrs = out_ptr + offs_t[:, None] * (hi - lo)[None, :] + plane[None, :]
    else:
        o_ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_c[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mt[:, None] & mc[None, :])
    if tok0 + BLOCK_T >= end:
        # The sequence's last block writes its final state: its last W - 1 inputs, taken from
        # the initial state too when the sequence is shorter than that.
        row = tl.load(final_rows_ptr + seq).to(tl.int64) if HAS_ROWS else seq
        f_ptrs = final_ptr + row * stride_fp + offs_c * stride_fc
        # (names distinct from the loop's above: Triton types a name once per scope)
        for p in tl.static_range(WIDTH - 1):
            last = end - (WIDTH - 1) + p
            val = tl.load(x_ptr + last * stride_xt + offs_c, mask=mc & (last >= start), other=0.0)
            val = val.to(tl.float32)
            if HAS_INIT:
                last_col = (WIDTH - 1) + (last - start)
                last_ms = mc & (last < start) & carry
                i_ptrs = init_ptr + seq * stride_in + offs_c * stride_ic
                val += tl.load(i_ptrs + last_col * stride_iw, mask=last_ms, other=0.0).to(
                    tl.float32
                )
            tl.store(f_ptrs + p * stride_fw, val.to(final_ptr.dtype.element_ty), mask=mc)


@lru_cache(maxsize=4)
def _block_tables(
    seq_lens: tuple[int, ...], block_t: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens and, per program row, its sequence and first token (host-built, copied once
    per step: every DeltaNet layer of a step has the same lengths). Shared: never write."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    cu = np.concatenate(([0], np.cumsum(lens)))
    blocks = -(-lens // block_t)
    seq = np.repeat(np.arange(len(lens)), blocks)
    first = np.concatenate(([0], np.cumsum(blocks)[:-1]))
    tok = cu[seq] + (np.arange(int(blocks.sum())) - first[seq]) * block_t
    return tuple(
        async_tensor_h2d(torch.from_numpy(a.astype(np.int32)), torch.int32, device)
        for a in (cu, seq, tok)
    )  # type: ignore[return-value]


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_lens: tuple[int, ...],
    init_states: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    final_states: torch.Tensor,
    final_rows: torch.Tensor | None = None,
    activation: str | None = "silu",
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Packed prefill sequences: `x: [T, dim]` (columns contiguous), T = sum(seq_lens).
    Sequence i starts from `init_states[i]` (`[N, dim, W - 1]`) when `has_initial_state[i]`
    (int32 device flags) is set, else from zeros (`init_states` None: all fresh); its final
    state goes to `final_states[final_rows[i]]` (`final_rows` None: row i), which must not
    alias `init_states`. Returns `[T, dim]` in x's dtype. `tiles`: (BLOCK_T, BLOCK_C,
    num_warps) in place of the module's (`benchmarks/bench_gdn.py` times candidates)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    args = (x, weight, bias, seq_lens, init_states, has_initial_state, final_states, final_rows)
    _launch_varlen(*args, activation, tiles, out, None)
    return out


def causal_conv1d_varlen_planes(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_lens: tuple[int, ...],
    init_states: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    final_states: torch.Tensor,
    final_rows: torch.Tensor | None,
    activation: str | None,
    splits: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`causal_conv1d_varlen` with its output channels cut at `splits` into three planes, each
    `[T, width]` and contiguous (Gated DeltaNet's q, k and v): fla's chunked kernel makes
    its inputs contiguous, which costs a copy of each column slice of a `[T, dim]` output."""
    s1, s2 = splits
    dim = weight.shape[0]
    if not 0 < s1 < s2 < dim:
        raise ValueError(f"splits {splits} must cut the {dim} channels into three parts")
    flat = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    args = (x, weight, bias, seq_lens, init_states, has_initial_state, final_states, final_rows)
    _launch_varlen(*args, activation, None, flat, splits)
    t = x.shape[0]
    return (
        flat[: t * s1].view(t, s1),
        flat[t * s1 : t * s2].view(t, s2 - s1),
        flat[t * s2 :].view(t, dim - s2),
    )


def _launch_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_lens: tuple[int, ...],
    init_states: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    final_states: torch.Tensor,
    final_rows: torch.Tensor | None,
    activation: str | None,
    tiles: tuple[int, int, int] | None,
    out: torch.Tensor,
    splits: tuple[int, int] | None,
) -> None:
    dim, width = weight.shape
    if x.dim() != 2 or x.shape[1] != dim or x.stride(1) != 1:
        raise ValueError(f"x must be [T, {dim}] with contiguous columns, got {tuple(x.shape)}")
    if sum(seq_lens) != x.shape[0] or any(n <= 0 for n in seq_lens):
        raise ValueError(f"seq_lens {list(seq_lens)} must be positive and sum to {x.shape[0]}")
    if (init_states is None) != (has_initial_state is None):
        raise ValueError("init_states and has_initial_state come together")
    block_t, block_c, warps = tiles or (_VARLEN_BLOCK_T, _VARLEN_BLOCK_C, _VARLEN_WARPS)
    s1, s2 = splits if splits is not None else (dim, dim)
    cu, block_seq, block_tok = map(kept, _block_tables(tuple(seq_lens), block_t, x.device))
    init = init_states if init_states is not None else final_states
    grid = (block_seq.shape[0], triton.cdiv(dim, block_c))
    _conv_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, init,
        has_initial_state if has_initial_state is not None else cu,
        final_states, final_rows if final_rows is not None else cu, out,
        cu, block_seq, block_tok,
        dim, x.stride(0), weight.stride(0), init.stride(0), init.stride(1), init.stride(2),
        final_states.stride(0), final_states.stride(1), final_states.stride(2), out.stride(0),
        x.shape[0], s1, s2,
        WIDTH=width, BLOCK_T=block_t, BLOCK_C=block_c,
        HAS_BIAS=bias is not None, HAS_INIT=init_states is not None,
        HAS_ROWS=final_rows is not None, SILU=activation == "silu",
        PLANES=splits is not None, num_warps=warps,
    )  # fmt: skip
