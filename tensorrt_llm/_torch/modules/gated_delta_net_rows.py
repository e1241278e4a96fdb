"""Short context rows of a Gated DeltaNet step that continue a state, run token by token in place.

An MTP verify row is a request's last token and its k drafts (1 + k tokens), a replay row the
accepted part of one; both continue the request's state. fla's chunked rule would run them as
a prefill: ~10 kernel launches a layer plus the gather and scatter of the states, all on the
host's critical path of a decode-sized step. Run as decode runs tokens instead, each row is one
program's loop over its tokens on the pool row itself (`gated_delta_rule_rows_`): one kernel,
the gates formed in it, and the same per-token arithmetic as the decode steps without
speculation. The rows the step's prefill chunks leave at the end of its context part (they
come first) take this path; the rest keep the chunked rule.

Rollback: a verify step records what each layer's rows path ran (`RowsRecord`); for a request
that rejected drafts `replay_rows` runs just the recurrence again for its accepted tokens, from
the state saved before the step (spec_decode/rollback.py): the conv state is a gather of its
last inputs, the SSM state one rows kernel a layer reading the recorded inputs in place. No
projection, attention or MLP runs again, and the pool rows are not restored first.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..._utils import async_tensor_h2d
from .gated_delta_net_metadata import GatedDeltaNetMetadata, StateRows
from .triton_kernels.conv_rollback import causal_conv1d_rollback_
from .triton_kernels.gdn_decode import (
    Gates,
    gated_delta_rule_replay_,
    gated_delta_rule_rows_,
    gdn_gates_torch,
)

if TYPE_CHECKING:
    from .gated_delta_net import GatedDeltaNet

# The longest row taken: a row's tokens are sequential steps of one program (each a few
# hundred cycles), where fla's chunked rule costs ~10 launches and their host work at any
# length; 32 covers verify rows (1 + k) and the rest of a block after a prompt-end snapshot
# point (tokens_per_block 32). Not measured yet at the crossover (bench_gdn.py times rows).
RECURRENT_ROWS_MAX_TOKENS = 32

# The conv output of a prefill as its q, k and v channel planes, each `[T, width]`.
QKVPlanes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def plane_rows(x: QKVPlanes, rows: slice) -> QKVPlanes:
    """Token rows `rows` of each plane (views: a plane's row slice stays contiguous)."""
    return x[0][rows], x[1][rows], x[2][rows]


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


@dataclass(frozen=True)
class RowsRecord:
    """One layer's rows path as it ran in a step (`GatedDeltaNetMetadata.record`): enough to
    run the rows again from their earlier state for fewer tokens (`replay_rows`, the MTP
    rollback) without the rest of the model. The tensors are the step's own activations."""

    layer: GatedDeltaNet
    conv: StateRows  # the conv pool by slot
    ssm: StateRows  # the SSM pool by slot
    first: int  # the context row of the first recorded row
    lens: tuple[int, ...]
    conv_in: torch.Tensor  # [sum(lens), conv_dim] the conv's inputs
    x: QKVPlanes  # its outputs, [sum(lens), width] each
    a: torch.Tensor  # [sum(lens), Hv] raw gates
    b: torch.Tensor
    fused: bool


def _rule(
    layer: GatedDeltaNet,
    x: QKVPlanes,
    a: torch.Tensor,
    b: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cu: tuple[int, ...],
    fused: bool,
) -> torch.Tensor:
    q, k, v = layer._split_heads(x)
    if fused:
        gates = (a, b, layer.A_log, layer.dt_bias)
        return gated_delta_rule_rows_(
            q, k, v, None, None, pool, slots, cu, gates=gates, backend="triton"
        )
    g, beta = gdn_gates_torch(a, b, layer.A_log, layer.dt_bias)
    return gated_delta_rule_rows_(q, k, v, g, beta, pool, slots, cu)


def rows_rule(
    layer: GatedDeltaNet,
    conv_in: torch.Tensor,
    x: QKVPlanes,
    a: torch.Tensor,
    b: torch.Tensor,
    conv: StateRows,
    ssm: StateRows,
    first: int,
    metadata: GatedDeltaNetMetadata,
    fused: bool,
) -> torch.Tensor:
    """Context rows `first..` (conv inputs `conv_in`, conv output planes `x`, raw gates `a`, `b`)
    from their pool rows, updated in place; returns `[tokens, Hv, V]`. Recorded in
    `metadata.record` when that is set."""
    assert ssm.slots is not None
    lens = metadata.context_lens[first:]
    slots = ssm.slots[first : first + len(lens)]
    o = _rule(layer, x, a, b, ssm.states, slots, (0, *itertools.accumulate(lens)), fused)
    if metadata.record is not None and conv.slots is not None:
        metadata.record.append(RowsRecord(layer, conv, ssm, first, lens, conv_in, x, a, b, fused))
    return o


# The most a step's records may hold alive until its rollback: they keep each layer's input
# projections and conv output of the rows (~2.5 MB a token for Qwen3.6-27B's 48 layers), memory
# the capacity probe did not see; within this bound they fit under the probe's prefill peak
# (a verify step's own activations are far smaller). Larger steps replay a forward instead.
RECORD_MAX_BYTES = 512 * 2**20


def covers(records: list[RowsRecord], rows: Sequence[int], num_layers: int) -> bool:
    """Whether each of the `num_layers` layers recorded the same rows, including context rows
    `rows`."""
    if len(records) != num_layers or len({id(r.layer) for r in records}) != num_layers:
        return False
    first, lens = records[0].first, records[0].lens
    if any(r.first != first or r.lens != lens for r in records):
        return False
    return all(first <= row < first + len(lens) for row in rows)


@dataclass(frozen=True)
class ReplayIndex:
    """Which recorded tokens a replay runs again, as int64 device vectors, one entry per
    replayed row r unless said: `tokens` the packed token rows of the records (row r's at
    `cu[r]:cu[r + 1]`), `slots` its pool row, `saved_rows` its row of the saved copies,
    `starts` / `keeps` where its recorded tokens start and how many it keeps. `cu` is host
    offsets, or a device vector under a CUDA graph (spec_decode/rollback_graphs.py)."""

    tokens: torch.Tensor
    slots: torch.Tensor
    saved_rows: torch.Tensor
    starts: torch.Tensor
    keeps: torch.Tensor
    cu: tuple[int, ...] | torch.Tensor


def replay_rows(
    records: list[RowsRecord],
    rows: Sequence[tuple[int, int]],
    slots: Sequence[int],
    saved: Mapping[int, torch.Tensor],
    saved_rows: Sequence[int],
) -> None:
    """Run each `(context row, tokens kept)` of `rows` again for its first tokens only, in
    every recorded layer, from the states saved before the step: `saved[pool.data_ptr()]` is
    the saved copy of a recorded pool's rows, row `saved_rows[i]` of it the state slot
    `slots[i]` held. Each layer's SSM rows run the rows kernel over the recorded inputs in
    place (`gated_delta_rule_replay_`) and its conv rows take the last kernel - 1 inputs
    (`causal_conv1d_rollback_`): two launches a layer, the pool rows `slots` overwritten with
    the states after the kept tokens. Every other pool row is untouched. The caller checks
    `covers` first."""
    if not rows:
        return
    if not covers(records, [row for row, _ in rows], len(records)):
        raise ValueError(f"rows {list(rows)} were not all recorded by every layer")
    first, lens = records[0].first, records[0].lens
    cu = (0, *itertools.accumulate(lens))
    starts = [cu[row - first] for row, _ in rows]
    keeps = [keep for _, keep in rows]
    if any(not 0 < keep <= lens[row - first] for row, keep in rows):
        raise ValueError(f"kept tokens of {list(rows)} must be in 1..the row's {lens}")
    tokens = [s + t for s, keep in zip(starts, keeps, strict=True) for t in range(keep)]
    vectors = _index_vectors(
        [tokens, list(slots), list(saved_rows), starts, keeps], records[0].a.device
    )
    replay_layers(records, ReplayIndex(*vectors, (0, *itertools.accumulate(keeps))), saved)


def replay_layers(
    records: list[RowsRecord], index: ReplayIndex, saved: Mapping[int, torch.Tensor]
) -> None:
    """`replay_rows`' two launches a layer over vectors already on the device; nothing here
    reads a device value or allocates beyond the kernels' outputs, so a CUDA graph can
    capture it."""
    for rec in records:
        layer = rec.layer
        backend = "triton" if rec.fused else "torch"
        q, k, v = layer._split_heads(rec.x)
        if rec.fused:
            gates: Gates | tuple[torch.Tensor, torch.Tensor] = (
                rec.a, rec.b, layer.A_log, layer.dt_bias
            )  # fmt: skip
        else:
            gates = gdn_gates_torch(rec.a, rec.b, layer.A_log, layer.dt_bias)
        ssm, conv = rec.ssm.states, rec.conv.states
        gated_delta_rule_replay_(
            q, k, v, gates, ssm, index.slots, index.cu, index.tokens,
            (saved[ssm.data_ptr()], index.saved_rows), backend=backend,
        )  # fmt: skip
        causal_conv1d_rollback_(
            conv, index.slots, saved[conv.data_ptr()], index.saved_rows, rec.conv_in,
            index.starts, index.keeps, backend=backend,
        )  # fmt: skip


def _index_vectors(vectors: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 device vectors from one host-to-device copy, each starting 16-byte aligned (two
    elements): Triton specializes a pointer argument on that alignment, and a view at an odd
    element offset would compile another variant of the kernel mid-serving."""
    flat: list[int] = []
    starts = []
    for v in vectors:
        starts.append(len(flat))
        flat += v + [0] * (len(v) % 2)
    packed = async_tensor_h2d(flat, torch.int64, device)
    return [packed[s : s + len(v)] for s, v in zip(starts, vectors, strict=True)]
