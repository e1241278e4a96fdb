"""Short context rows of a Gated DeltaNet step that continue a state, run token by token in place.

An MTP verify row is a request's last token and its k drafts (1 + k tokens), a replay row the
accepted part of one; both continue the request's state. fla's chunked rule would run them as
a prefill: ~10 kernel launches a layer plus the gather and scatter of the states, all on the
host's critical path of a decode-sized step. Run as decode runs tokens instead, each row is one
program's loop over its tokens on the pool row itself (`gated_delta_rule_rows_`): one kernel,
the gates formed in it, and the same per-token arithmetic as the decode steps without
speculation. The rows the step's prefill chunks leave at the end of its context part (they
come first) take this path; the rest keep the chunked rule.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from .gated_delta_net_metadata import GatedDeltaNetMetadata, StateRows
from .triton_kernels.gdn_decode import gated_delta_rule_rows_, gdn_gates_torch

if TYPE_CHECKING:
    from .gated_delta_net import GatedDeltaNet

# The longest row taken: a row's tokens are sequential steps of one program, so a chunked
# kernel wins from a few tens of tokens; verify rows are 1 + k.
RECURRENT_ROWS_MAX_TOKENS = 16


def short_rows_from(metadata: GatedDeltaNetMetadata, in_place: bool) -> int:
    """The first context row of the longest suffix of rows that continue a state, none longer
    than `RECURRENT_ROWS_MAX_TOKENS` and none with a snapshot inside it (`num_contexts`: no
    such row). `in_place`: the layer addresses pool rows by slot and may update them in place."""
    cut = metadata.num_contexts
    if not in_place:
        return cut
    snapshot_rows = {row for row, _, _ in metadata.snapshots}
    while (
        cut > 0
        and metadata.has_initial_state[cut - 1]
        and metadata.context_lens[cut - 1] <= RECURRENT_ROWS_MAX_TOKENS
        and cut - 1 not in snapshot_rows
    ):
        cut -= 1
    return cut


def rows_rule(
    layer: GatedDeltaNet,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm: StateRows,
    first: int,
    lens: tuple[int, ...],
    fused: bool,
) -> torch.Tensor:
    """Context rows `first..` of `lens` tokens (conv output `x`, raw gates `a`, `b`) from their
    pool rows, updated in place; returns `[sum(lens), Hv, V]`."""
    q, k, v = layer._split_heads(x)
    assert ssm.slots is not None
    slots = ssm.slots[first : first + len(lens)]
    cu = (0, *itertools.accumulate(lens))
    if fused:
        gates = (a, b, layer.A_log, layer.dt_bias)
        return gated_delta_rule_rows_(
            q, k, v, None, None, ssm.states, slots, cu, gates=gates, backend="triton"
        )
    g, beta = gdn_gates_torch(a, b, layer.A_log, layer.dt_bias)
    return gated_delta_rule_rows_(q, k, v, g, beta, ssm.states, slots, cu)
