"""Causal depthwise conv1d with a carried state: Gated DeltaNet's short convolution.

Each channel c of a sequence x is filtered causally,
    y[t, c] = act(bias[c] + sum_j weight[c, j] * x[t - (width - 1) + j, c]),
where the `width - 1` inputs before the sequence start come from the conv state (zeros for a
fresh request). The conv state of a sequence is its last `width - 1` inputs, channel-major:
`[dim, width - 1]`, the layout HF's cache and the causal-conv1d kernels use.

Token tensors are token-major (`[T, dim]`) like every packed hidden state in the engine. The
state tensors are per request (`[N, dim, width - 1]`, already gathered by seq slot) and are
updated in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..._utils import async_tensor_h2d, step_constant

_ACTIVATIONS = ("silu", None)


def _check(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, activation: str | None
) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    dim, width = weight.shape
    if width < 2:
        raise ValueError(f"causal conv1d needs a kernel width >= 2, got {width}")
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"x must be [tokens, {dim}], got {tuple(x.shape)}")
    if conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != (dim, width - 1):
        raise ValueError(
            f"conv_states must be [N, {dim}, {width - 1}], got {tuple(conv_states.shape)}"
        )


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


def _check_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: Sequence[int],
    conv_states: torch.Tensor,
    has_initial_state: Sequence[bool] | None,
    activation: str | None,
) -> None:
    _check(x, weight, conv_states, activation)
    if len(seq_lens) != conv_states.shape[0] or sum(seq_lens) != x.shape[0]:
        raise ValueError(
            f"seq_lens {list(seq_lens)} must have one entry per conv state "
            f"({conv_states.shape[0]}) and sum to the token count {x.shape[0]}"
        )
    if has_initial_state is not None and len(has_initial_state) != len(seq_lens):
        raise ValueError(
            f"has_initial_state has {len(has_initial_state)} entries for {len(seq_lens)} sequences"
        )


def _tap_sources(seq_lens: tuple[int, ...], history: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices into `[history rows of every sequence; packed tokens]` (host-side).

    Returns `taps: [T, history + 1]` (tap j of token t reads row taps[t, j]) and
    `last: [N, history]` (the rows that become each sequence's new conv state).
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    num_seqs, hist_rows = len(lens), len(lens) * history
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    seq = np.repeat(np.arange(num_seqs), lens)
    local = np.arange(int(lens.sum())) - starts[seq]

    def rows(seq_ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        # pos < 0 falls into the sequence's own history rows (its conv state, oldest first).
        return np.where(
            pos >= 0, hist_rows + starts[seq_ids] + pos, seq_ids * history + history + pos
        )

    offsets = np.arange(-history, 1)
    taps = rows(seq[:, None], local[:, None] + offsets[None, :])
    last_pos = lens[:, None] - history + np.arange(history)[None, :]
    last = rows(np.arange(num_seqs)[:, None], last_pos)
    return taps, last


@lru_cache(maxsize=4)
def _tap_tables(
    seq_lens: tuple[int, ...], history: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_tap_sources` on `device`: taps as `[width, T]` (one contiguous index row per tap)
    and the new-state rows flattened to `[N * history]`.

    Cached: every DeltaNet layer of a step has the same lengths, so the tables are built and
    copied once per step. Shared: never write to them.
    """
    taps, last = _tap_sources(seq_lens, history)
    taps_d = async_tensor_h2d(torch.from_numpy(np.ascontiguousarray(taps.T)), torch.long, device)
    return taps_d, async_tensor_h2d(torch.from_numpy(last.reshape(-1)), torch.long, device)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_lens: Sequence[int],
    conv_states: torch.Tensor,
    has_initial_state: Sequence[bool] | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Prefill (or a prefill chunk) of packed sequences, all sequences at once.

    x: [T, dim] with T = sum(seq_lens); weight: [dim, width]; conv_states: [N, dim, width-1],
    N = len(seq_lens). Sequence i starts from conv_states[i] when has_initial_state[i] (a
    later chunk of a chunked prefill) and from zeros otherwise (a fresh request; None means all
    fresh). conv_states[i] is overwritten with the sequence's final state. Returns [T, dim].

    Every request's history rows and tokens sit in one source table, and each of the `width`
    taps is one gather over it, so the cost does not grow with the number of requests (a
    per-request conv launches ~6 kernels per request per layer). Same maths as
    `causal_conv1d_fn_ref`.
    """
    _check_prefill(x, weight, seq_lens, conv_states, has_initial_state, activation)
    dim, width = weight.shape
    flags = [bool(f) for f in has_initial_state or [False] * len(seq_lens)]
    history = conv_states.transpose(1, 2).to(weight.dtype)  # [N, width-1, dim]
    if not any(flags):
        history = torch.zeros_like(history)
    elif not all(flags):  # fresh requests start from zeros, whatever their slot held before
        keep = step_constant(tuple(flags), torch.bool, x.device)
        history = torch.where(keep[:, None, None], history, 0)
    source = torch.cat([history.reshape(-1, dim), x.to(weight.dtype)])
    taps_d, last_d = _tap_tables(tuple(int(n) for n in seq_lens), width - 1, x.device)
    # addcmul_ accumulates in float32 without a float copy of each gathered [T, dim] slab.
    acc = torch.zeros(x.shape[0], dim, dtype=torch.float32, device=x.device)
    w32 = weight.float()
    for j in range(width):
        acc.addcmul_(source.index_select(0, taps_d[j]), w32[:, j])
    if bias is not None:
        acc += bias.float()
    new_states = source.index_select(0, last_d).view(len(seq_lens), width - 1, dim)
    conv_states.copy_(new_states.transpose(1, 2))
    return _activate(acc, activation).to(x.dtype)


def causal_conv1d_fn_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_lens: Sequence[int],
    conv_states: torch.Tensor,
    has_initial_state: Sequence[bool] | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Prefill (or a prefill chunk) of packed sequences, one request at a time: the readable
    reference for `causal_conv1d_fn`.

    x: [T, dim] with T = sum(seq_lens); weight: [dim, width]; conv_states: [N, dim, width-1],
    N = len(seq_lens). Sequence i starts from conv_states[i] when has_initial_state[i] (a
    later chunk of a chunked prefill) and from zeros otherwise (a fresh request; None means all
    fresh). conv_states[i] is overwritten with the sequence's final state. Returns [T, dim].
    """
    _check_prefill(x, weight, seq_lens, conv_states, has_initial_state, activation)
    dim, width = weight.shape
    out = torch.empty_like(x)
    start = 0
    for i, length in enumerate(seq_lens):
        if has_initial_state is not None and has_initial_state[i]:
            history = conv_states[i].to(weight.dtype)
        else:
            history = weight.new_zeros(dim, width - 1)
        # [dim, width-1+L]: the state first, so a plain (unpadded) conv is causal.
        padded = torch.cat([history, x[start : start + length].t().to(weight.dtype)], dim=1)
        y = F.conv1d(padded[None], weight[:, None, :], bias, groups=dim)[0]
        out[start : start + length] = _activate(y, activation).t().to(x.dtype)
        conv_states[i].copy_(padded[:, padded.shape[1] - (width - 1) :])
        start += length
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step for N requests; torch reference.

    x: [N, dim] (one new token each); conv_states: [N, dim, width-1], shifted in place to
    include the new token. Returns [N, dim].
    NOTE: shapes only, no host sync, so a decode CUDA graph can capture it.
    """
    _check(x, weight, conv_states, activation)
    if x.shape[0] != conv_states.shape[0]:
        raise ValueError(f"{x.shape[0]} decode tokens for {conv_states.shape[0]} conv states")
    window = torch.cat([conv_states.to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=2)
    y = (window * weight[None]).sum(dim=-1)
    if bias is not None:
        y = y + bias
    conv_states.copy_(window[:, :, 1:])
    return _activate(y, activation).to(x.dtype)


class CausalConv1d(nn.Module):
    """Holds the depthwise filter in HF's `nn.Conv1d` layout, `weight: [dim, 1, width]`, so
    checkpoints load without reshaping."""

    def __init__(
        self,
        dim: int,
        kernel_size: int,
        bias: bool = False,
        activation: str | None = "silu",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dim <= 0 or kernel_size < 2:
            raise ValueError(
                f"CausalConv1d needs dim > 0 and kernel_size >= 2, got {dim}, {kernel_size}"
            )
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
        self.dim = dim
        self.kernel_size = kernel_size
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel_size, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype)) if bias else None

    def forward(
        self,
        x: torch.Tensor,
        seq_lens: Sequence[int],
        conv_states: torch.Tensor,
        has_initial_state: Sequence[bool] | None = None,
    ) -> torch.Tensor:
        """Prefill of packed sequences; see `causal_conv1d_fn`."""
        return causal_conv1d_fn(
            x,
            self.weight[:, 0],
            self.bias,
            seq_lens,
            conv_states,
            has_initial_state,
            self.activation,
        )

    def step(self, x: torch.Tensor, conv_states: torch.Tensor) -> torch.Tensor:
        """One decode token per request; see `causal_conv1d_update`."""
        return causal_conv1d_update(x, conv_states, self.weight[:, 0], self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, kernel_size={self.kernel_size}, activation={self.activation}"
