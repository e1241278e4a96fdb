"""The recurrent state of a Gated DeltaNet layer at a position inside a prefill chunk.

Prefix caching on hybrid models snapshots the conv / SSM state at block-aligned positions
(`GatedDeltaNetMetadata.snapshots`). Ending the chunk there costs the request a whole engine
step per point, so the layer instead writes the state at the point into a scratch seq slot
while it runs the chunk:
- conv: the state after the first `off` new tokens is the last `kernel - 1` conv inputs
  before that position, taken from the chunk's inputs (and from the initial state when
  `off < kernel - 1`): no recurrence;
- SSM: the chunk recurrence runs in two passes, the first over every context row with the
  split rows cut at their point, the second over the split rows' rest starting from the
  first pass's final state (which is also the snapshot). The chunked kernel carries its
  state across chunk boundaries exactly this way, so outputs and final states match one pass.
  When every such rest is short (a prompt-end point lies within the last block), the second
  pass runs token by token in place instead (`gated_delta_rule_rows_`): one kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..._utils import step_constant
from .gated_delta_net_metadata import GatedDeltaNetMetadata, StateRows
from .gated_delta_net_rows import RECURRENT_ROWS_MAX_TOKENS
from .gated_delta_rule import chunk_gated_delta_rule
from .triton_kernels.gdn_decode import gated_delta_rule_rows_

# (q, k, v, g, beta, initial state or None, cu_seqlens) -> (o [T, Hv, V], final [N, ...])
Rule = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        tuple[int, ...],
    ],
    tuple[torch.Tensor, torch.Tensor],
]


def varlen_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor | None,
    cu_seqlens: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule over packed sequences: (o [T, Hv, V], final states [N, Hv, K, V])."""
    o, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial, True,
        use_qk_l2norm=True, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    assert final is not None
    return o[0], final


def _scratch_slots(metadata: GatedDeltaNetMetadata, device: torch.device) -> torch.Tensor:
    return step_constant(tuple(s for _, _, s in metadata.snapshots), torch.int64, device)


def _require_pool(rows: StateRows) -> torch.Tensor:
    if rows.slots is None:
        raise ValueError("snapshots inside a chunk need the state pools (conv_slots, ssm_slots)")
    return rows.slots


def write_conv_snapshots(x: torch.Tensor, conv: StateRows, metadata: GatedDeltaNetMetadata) -> None:
    """Write each snapshot's conv state into its scratch slot's row of the conv pool.

    `x`: the context rows' conv inputs `[T_ctx, conv_dim]`; `conv`: the context rows of the
    pool, still holding their initial states (called before the conv overwrites them)."""
    slots = _require_pool(conv)
    width = conv.states.shape[-1]  # kernel - 1
    cu = metadata.cu_seqlens
    states = []
    for row, off, _ in metadata.snapshots:
        begin = cu[row]
        tail = x[begin + max(0, off - width) : begin + off].t()  # [conv_dim, <= width]
        if off < width:  # the rest comes from the state the chunk started from
            lo = conv.lo + row
            if metadata.has_initial_state[row]:
                prev = conv.states.index_select(0, slots[lo : lo + 1])[0]
            else:
                prev = tail.new_zeros(tail.shape[0], width)
            tail = torch.cat([prev[:, off:].to(tail.dtype), tail], dim=1)
        states.append(tail)
    stacked = torch.stack(states).to(conv.states.dtype)
    conv.states.index_copy_(0, _scratch_slots(metadata, conv.device), stacked)


def _take(t: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of `spans` packed; adjacent spans are merged first, so the common step (one
    split request, packed last) slices without a copy."""
    merged = [list(spans[0])]
    for a, b in spans[1:]:
        if a == merged[-1][1]:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    if len(merged) == 1:
        return t[merged[0][0] : merged[0][1]]
    return torch.cat([t[a:b] for a, b in merged])


def _offsets(spans: list[tuple[int, int]]) -> tuple[int, ...]:
    cu = [0]
    for a, b in spans:
        cu.append(cu[-1] + b - a)
    return tuple(cu)


def split_prefill_rule(
    rule: Rule,
    tensors: tuple[torch.Tensor, ...],
    initial: torch.Tensor | None,
    ssm: StateRows,
    metadata: GatedDeltaNetMetadata,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context rows' recurrence in two passes (module docstring); the state at each
    snapshot point goes to its scratch slot's row of the SSM pool. `tensors`: q, k, v, g,
    beta packed along T. `in_place`: the second pass may run in place on the split rows' own
    pool rows when every rest is short (`gated_delta_net_rows.py`). Returns (o `[T_ctx, Hv,
    V]` in packing order, final states `[N, ...]`).
    """
    pool_slots = _require_pool(ssm)
    cu = metadata.cu_seqlens
    cut = {row: off for row, off, _ in metadata.snapshots}
    first = [(cu[i], cu[i] + cut.get(i, n)) for i, n in enumerate(metadata.context_lens)]
    split_rows = [row for row, _, _ in metadata.snapshots]
    second = [(cu[row] + cut[row], cu[row + 1]) for row in split_rows]
    o1, final1 = rule(*(_take(t, first) for t in tensors), initial, _offsets(first))
    rows_d = step_constant(tuple(split_rows), torch.int64, final1.device)
    mid = final1.index_select(0, rows_d)
    ssm.states.index_copy_(0, _scratch_slots(metadata, ssm.device), mid.to(ssm.states.dtype))
    rest = tuple(_take(t, second) for t in tensors)
    if in_place and max(b - a for a, b in second) <= RECURRENT_ROWS_MAX_TOKENS:
        # The rest of each split row is short (a prompt-end point: under a block): run it
        # token by token on the row's own pool row, which the caller overwrites with the
        # final state anyway, instead of a second chunked call.
        own = pool_slots[ssm.lo : ssm.hi].index_select(0, rows_d)
        ssm.states.index_copy_(0, own, mid.to(ssm.states.dtype))
        o2 = gated_delta_rule_rows_(*rest, ssm.states, own, _offsets(second))
        final2 = ssm.states.index_select(0, own)
    else:
        o2, final2 = rule(*rest, mid, _offsets(second))
    final = final1.index_copy(0, rows_d, final2.to(final1.dtype))
    # Back to packing order: each row's first-pass tokens, then its second-pass ones.
    cu1, cu2 = _offsets(first), _offsets(second)
    where = {row: j for j, row in enumerate(split_rows)}
    pieces = []
    for i in range(metadata.num_contexts):
        pieces.append(o1[cu1[i] : cu1[i + 1]])
        j = where.get(i)
        if j is not None:
            pieces.append(o2[cu2[j] : cu2[j + 1]])
    return torch.cat(pieces), final
