"""The state at a point inside a prefill chunk (`GatedDeltaNetMetadata.snapshots`): the
two-pass prefill gives the one-pass outputs and final states, and the state written into the
scratch slot equals a separate prefill up to the point."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.modules.gated_delta_net import GatedDeltaNet, GatedDeltaNetMetadata

HIDDEN = 32
# ~1e-6 on the CPU. On CUDA fla's chunk kernels multiply in tf32 (10-bit mantissa): where both
# passes chunk (mid points) they agree to ~1e-4, but past a prompt-end point the two-pass step
# runs the fp32 rows kernel against the one-pass chunk, and they differ by up to ~4e-4 (H200,
# 9d6a6f4: 13 of 4512 outputs over 1e-4). A wrong offset or state is off by O(0.1).
TOL = dict(atol=1e-3, rtol=1e-3)


def _layer() -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, 2, 4, 8, 6, conv_kernel_size=4)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer.eval()


def _pools(layer: GatedDeltaNet, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    conv = torch.randn(rows, *layer.conv_state_shape, generator=gen)
    ssm = torch.randn(rows, *layer.ssm_state_shape, generator=gen)
    return conv, ssm


# Context rows (new tokens, carries state, snapshot offset or None), then 2 decode rows.
# Offsets: inside the conv window (1 < kernel - 1), at a 64-token chunk edge, mid-chunk.
ROWS = [(40, False, 1), (130, True, 64), (20, False, None), (70, True, 37)]
# Prompt-end points: every rest after a point is short, so the second pass runs in place.
END_ROWS = [(40, False, 32), (20, True, 12), (9, False, None), (70, True, 64)]
SLOTS = [5, 0, 2, 7, 1, 3]  # seq slots of the 6 rows (4 contexts, 2 decodes)
SCRATCH = {0: 4, 1: 6, 3: 8}  # context row -> scratch slot


def _meta(snapshots: bool, rows: list = ROWS) -> GatedDeltaNetMetadata:
    return GatedDeltaNetMetadata(
        context_lens=tuple(n for n, _, _ in rows),
        has_initial_state=tuple(c for _, c, _ in rows),
        num_decodes=2,
        snapshots=tuple((i, off, SCRATCH[i]) for i, (_, _, off) in enumerate(rows) if off)
        if snapshots
        else (),
    )


@torch.no_grad()
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("rows", [ROWS, END_ROWS], ids=["mid", "prompt_end"])
def test_two_pass_prefill_equals_one_pass_and_snapshots_equal_prefix_prefill(
    backend: str, device: str, rows: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh and carried rows, offsets inside the conv window and at or off a 64-token
    chunk edge, decode rows after them; torch and Triton (varlen conv) kernels, and fla's
    chunk kernels on CUDA. With prompt-end points the second pass runs in place (counted)."""
    from tensorrt_llm._torch.modules import gated_delta_net_snapshot as snapshot_module

    calls: list[tuple[int, ...]] = []
    in_place = snapshot_module.gated_delta_rule_rows_

    def spy(*args, **kwargs):
        calls.append(args[7])
        return in_place(*args, **kwargs)

    monkeypatch.setattr(snapshot_module, "gated_delta_rule_rows_", spy)
    layer = _layer().to(device)
    layer.kernel_backend = backend
    conv0, ssm0 = (t.to(device) for t in _pools(layer, 9))
    tokens = sum(n for n, _, _ in rows) + 2
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(5)).to(device)
    slots = torch.tensor(SLOTS, device=device)
    conv1, ssm1 = conv0.clone(), ssm0.clone()
    want = layer(x, conv1, ssm1, _meta(False, rows), ssm_slots=slots, conv_slots=slots)
    conv2, ssm2 = conv0.clone(), ssm0.clone()
    got = layer(x, conv2, ssm2, _meta(True, rows), ssm_slots=slots, conv_slots=slots)
    assert calls == ([(0, 8, 16, 22)] if rows is END_ROWS else [])
    torch.testing.assert_close(got, want, **TOL)
    scratch = list(SCRATCH.values())
    others = [r for r in range(9) if r not in scratch]
    torch.testing.assert_close(ssm2[others], ssm1[others], **TOL)
    torch.testing.assert_close(conv2[others], conv1[others], **TOL)
    # The one-pass step left the scratch rows alone; the two-pass one wrote them.
    assert torch.equal(ssm1[scratch], ssm0[scratch])
    assert not torch.allclose(ssm2[scratch], ssm0[scratch])
    begin = 0
    for i, (n, carry, off) in enumerate(rows):
        if off:
            # A separate prefill of this row's first `off` tokens from its initial state.
            conv, ssm = conv0[SLOTS[i]][None].clone(), ssm0[SLOTS[i]][None].clone()
            layer(x[begin : begin + off], conv, ssm, GatedDeltaNetMetadata((off,), (carry,)))
            torch.testing.assert_close(ssm2[SCRATCH[i]], ssm[0], **TOL)
            torch.testing.assert_close(conv2[SCRATCH[i]], conv[0], **TOL)
        begin += n


def test_snapshot_metadata_is_checked() -> None:
    with pytest.raises(ValueError, match="strictly inside"):
        GatedDeltaNetMetadata((8,), (False,), snapshots=((0, 8, 1),))
    with pytest.raises(ValueError, match="strictly inside"):
        GatedDeltaNetMetadata((8, 4), (False, False), snapshots=((0, 2, 1), (0, 3, 2)))
    layer = _layer()
    conv, ssm = _pools(layer, 1)
    meta = GatedDeltaNetMetadata((8,), (False,), snapshots=((0, 4, 0),))
    with pytest.raises(ValueError, match="state pools"):
        layer(torch.randn(8, HIDDEN), conv, ssm, meta)
