"""Gated DeltaNet's Triton kernels (gates fused into the in-place recurrence, gated RMSNorm),
the layer's Triton path, its in-place rows and the MTP replay, against the layer's torch path,
which test_gated_delta_net.py checks against HF. The conv kernels: test_gdn_conv_kernels.py.

Without CUDA the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at tiny float32
sizes; the interpreter rounds float32 -> bf16 by truncation, so 16-bit rounding is checked on
the GPU only (`@pytest.mark.gpu`, Qwen3.6-27B DeltaNet sizes)."""

from __future__ import annotations

import copy

import pytest
import torch

from tensorrt_llm._torch.modules.gated_delta_net import GatedDeltaNet, GatedDeltaNetMetadata
from tensorrt_llm._torch.modules.triton_kernels.gated_rms_norm import (
    rms_norm_gated,
    rms_norm_gated_torch,
)
from tensorrt_llm._torch.modules.triton_kernels.gdn_decode import (
    gated_delta_rule_decode_,
    gdn_gates_torch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIGHT = dict(atol=1e-5, rtol=1e-5)
# Layer outputs and SSM states: on CUDA the prefill runs fla's chunk kernels (TF32 dots).
LAYER = dict(atol=1e-2, rtol=1e-2) if DEVICE == "cuda" else dict(atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- kernels


def test_replay_index_vectors_start_16_byte_aligned() -> None:
    """Odd lengths are padded: every vector's pointer stays 16-byte aligned (one Triton
    specialization for any token count) and holds exactly its values."""
    from tensorrt_llm._torch.modules.gated_delta_net_rows import _index_vectors

    vectors = [[5, 6, 7], [1], [2, 3], [9, 8, 7, 6, 5]]
    got = _index_vectors(vectors, torch.device(DEVICE))
    assert [t.tolist() for t in got] == vectors
    assert all(t.data_ptr() % 16 == 0 and t.dtype == torch.int64 for t in got)


def test_gated_rms_norm_matches_torch_with_strided_gate() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 48, generator=gen)
    z = torch.randn(5, 3 * 48 + 10, generator=gen)[:, : 3 * 48].reshape(5, 3, 48)
    w = torch.randn(48, generator=gen)
    want = rms_norm_gated_torch(x, z, w, 1e-6).reshape(5, -1)
    got = rms_norm_gated(x.to(DEVICE), z.to(DEVICE), w.to(DEVICE), 1e-6, backend="triton")
    torch.testing.assert_close(got.cpu(), want, **TIGHT)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_gated(x, z, w[:4], 1e-6)


def test_decode_forms_gates_in_kernel() -> None:
    """gates=(a, b, A_log, dt_bias) equals passing the torch gates, including a + dt_bias
    above softplus's threshold of 20."""
    gen = torch.Generator().manual_seed(3)
    n, hk, hv, dk, dv = 3, 2, 4, 16, 48
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    a, b = torch.randn(n, hv, generator=gen) * 4, torch.randn(n, hv, generator=gen)
    a[0, 0] = 30.0
    a_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen)
    pool = torch.randn(5, hv, dk, dv, generator=gen)
    slots = torch.tensor([3, 0, 4])
    want_pool = pool.clone()
    pool = pool.clone()  # .to(DEVICE) below may return this very tensor
    g, beta = gdn_gates_torch(a, b, a_log, dt_bias)
    want = gated_delta_rule_decode_(q, k, v, g, beta, want_pool, slots, backend="torch")
    dev = [t.to(DEVICE) for t in (q, k, v, pool, slots, a, b, a_log, dt_bias)]
    got = gated_delta_rule_decode_(
        *dev[:3], None, None, dev[3], dev[4], gates=tuple(dev[5:]), backend="triton"
    )
    torch.testing.assert_close(got.cpu(), want, **TIGHT)
    torch.testing.assert_close(dev[3].cpu(), want_pool, **TIGHT)
    with pytest.raises(ValueError, match="either g and beta"):
        gated_delta_rule_decode_(*dev[:3], g, None, dev[3], dev[4], gates=tuple(dev[5:]))


# ----------------------------------------------------------------------------- the layer


def _layer(seed: int = 0, **sizes: int) -> GatedDeltaNet:
    dims = dict(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=24)
    torch.manual_seed(seed)
    layer = GatedDeltaNet(**{**dims, **sizes})
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer.eval()


def _meta(lens=(), carry=(), decodes: int = 0) -> GatedDeltaNetMetadata:
    return GatedDeltaNetMetadata(tuple(lens), tuple(carry), decodes)


# (metadata, rows of the pool in batch order): a mixed step (fresh context, continuing chunk,
# decode), decode only, chunked prefill continuing for all plus a decode.
_STEPS = [
    (_meta([5, 3], [False, True], decodes=1), [4, 1, 3]),
    (_meta(decodes=3), [4, 1, 3]),
    (_meta([70, 2], [True, True], decodes=2), [1, 3, 4, 0]),
]


@torch.no_grad()
@pytest.mark.parametrize("by_slot", [True, False])
def test_layer_triton_path_matches_torch_path(by_slot: bool) -> None:
    """The fused kernels (conv pool rows by slot with `conv_slots`, else per-request rows)
    against the torch path over mixed, decode-only and chunked steps."""
    ref = _layer()
    ref.kernel_backend = "torch"
    ours = copy.deepcopy(ref).to(DEVICE)
    ours.kernel_backend = "triton"
    gen = torch.Generator().manual_seed(4)
    conv_pool = torch.randn(6, *ref.conv_state_shape, generator=gen)
    ssm_pool = torch.randn(6, *ref.ssm_state_shape, generator=gen)
    conv_d, ssm_d = conv_pool.clone().to(DEVICE), ssm_pool.clone().to(DEVICE)
    for meta, slots in _STEPS:
        x = torch.randn(meta.num_tokens, 32, generator=gen)
        s = torch.tensor(slots)
        if by_slot:
            want = ref(x, conv_pool, ssm_pool, meta, ssm_slots=s, conv_slots=s)
            got = ours(
                x.to(DEVICE), conv_d, ssm_d, meta, ssm_slots=s.to(DEVICE), conv_slots=s.to(DEVICE)
            )
        else:  # the caller gathers and scatters the conv rows (the old model contract)
            conv_rows, conv_rows_d = conv_pool[s], conv_d[s.to(DEVICE)]
            want = ref(x, conv_rows, ssm_pool, meta, ssm_slots=s)
            got = ours(x.to(DEVICE), conv_rows_d, ssm_d, meta, ssm_slots=s.to(DEVICE))
            conv_pool[s], conv_d[s.to(DEVICE)] = conv_rows, conv_rows_d
        torch.testing.assert_close(got.cpu(), want, **LAYER)
        torch.testing.assert_close(conv_d.cpu(), conv_pool, **TIGHT)
        torch.testing.assert_close(ssm_d.cpu(), ssm_pool, **LAYER)


@torch.no_grad()
def test_layer_triton_path_per_request_states() -> None:
    """No slots at all (per-request conv and SSM rows): the fused conv and norm, fla's or the
    torch recurrence."""
    ref = _layer(seed=1)
    ref.kernel_backend = "torch"
    ours = copy.deepcopy(ref).to(DEVICE)
    ours.kernel_backend = "triton"
    gen = torch.Generator().manual_seed(5)
    meta = _meta([6], [True], decodes=2)
    conv = torch.randn(3, *ref.conv_state_shape, generator=gen)
    ssm = torch.randn(3, *ref.ssm_state_shape, generator=gen)
    conv_d, ssm_d = conv.clone().to(DEVICE), ssm.clone().to(DEVICE)
    x = torch.randn(8, 32, generator=gen)
    want = ref(x, conv, ssm, meta)
    got = ours(x.to(DEVICE), conv_d, ssm_d, meta)
    torch.testing.assert_close(got.cpu(), want, **LAYER)
    torch.testing.assert_close(conv_d.cpu(), conv, **TIGHT)
    torch.testing.assert_close(ssm_d.cpu(), ssm, **LAYER)
    with pytest.raises(ValueError, match="conv_slots must be"):
        ours(x.to(DEVICE), conv_d, ssm_d, meta, conv_slots=torch.zeros(2, dtype=torch.long))


# ----------------------------------------------------------------------------- GPU, 27B sizes

# Qwen3.6-27B's DeltaNet (benchmarks/configs/qwen3_6_27b.json)
_27B = dict(hidden_size=5120, num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128)


def _bf16_layer_27b() -> GatedDeltaNet:
    """bf16 on CUDA with weights of realistic scale (HF's init: A ~ U(0, 16))."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(**_27B, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1e-3, 16).log())
            elif name == "norm.weight":
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.startswith("conv1d"):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.02)
    return layer.eval()


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)
    assert err < rel, f"relative error {err:.2e} >= {rel}"


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_27b_layer_steps_bf16_match_torch_path() -> None:
    """Mixed (fresh + chunked context, decodes), decode-only at 16 requests, then a graph
    captured decode step replayed: outputs and both pools against the torch path."""
    ref = _bf16_layer_27b()
    ref.kernel_backend = "torch"
    ours = copy.deepcopy(ref)
    ours.kernel_backend = "auto"
    conv_ref = torch.randn(40, *ref.conv_state_shape, device="cuda").bfloat16()
    ssm_ref = torch.randn(40, *ref.ssm_state_shape, device="cuda") * 0.1
    conv, ssm = conv_ref.clone(), ssm_ref.clone()
    perm = torch.randperm(39, device="cuda") + 1
    steps = [
        (_meta([300, 100], [False, True], decodes=4), perm[:6]),
        (_meta(decodes=16), perm[:16]),
        (_meta([65], [True], decodes=15), perm[:16]),
    ]
    for meta, slots in steps:
        x = torch.randn(meta.num_tokens, 5120, device="cuda").bfloat16()
        want = ref(x, conv_ref, ssm_ref, meta, ssm_slots=slots, conv_slots=slots)
        got = ours(x, conv, ssm, meta, ssm_slots=slots, conv_slots=slots)
        _close(got, want, 2e-2)
        _close(conv, conv_ref, 1e-2)
        _close(ssm, ssm_ref, 1e-2)
    meta, slots = _meta(decodes=16), perm[:16]
    x = torch.randn(16, 5120, device="cuda").bfloat16()
    ours(x, conv.clone(), ssm.clone(), meta, ssm_slots=slots, conv_slots=slots)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ours(x, conv, ssm, meta, ssm_slots=slots, conv_slots=slots)
    graph.replay()
    want = ref(x, conv_ref, ssm_ref, meta, ssm_slots=slots, conv_slots=slots)
    _close(out, want, 2e-2)
    _close(ssm, ssm_ref, 1e-2)


@pytest.mark.gpu
def test_gpu_gated_rms_norm_bf16_rounds_like_torch() -> None:
    """48 value heads of 128, gate a strided view: at most a rare 1-ulp difference."""
    torch.manual_seed(0)
    x = torch.randn(64, 48, 128, device="cuda").bfloat16()
    z = torch.randn(64, 2 * 48 * 128, device="cuda").bfloat16()[:, 48 * 128 :].view(64, 48, 128)
    w = (1 + 0.1 * torch.randn(128, device="cuda")).bfloat16()
    want = rms_norm_gated_torch(x, z, w, 1e-6).reshape(64, -1)
    got = rms_norm_gated(x, z, w, 1e-6, backend="triton")
    differ = got != want
    assert differ.float().mean() < 1e-2
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@torch.no_grad()
def test_in_projections_become_one_gemm_and_loads_write_through() -> None:
    """After the post-load step both projections are views of one weight; a later weight
    load writes through them, and replaced weights are re-joined when the step runs again."""
    ref = _layer(seed=2)
    ref.kernel_backend = "torch"
    ours = copy.deepcopy(ref)
    ours.kernel_backend = "auto"  # the plain layer on the CPU: torch kernels, one GEMM
    assert ours.fuse_in_projections_()
    meta = _meta(decodes=2)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 32, generator=gen)

    def run(layer: GatedDeltaNet) -> torch.Tensor:
        conv, ssm = torch.zeros(2, *layer.conv_state_shape), torch.zeros(2, *layer.ssm_state_shape)
        return layer(x, conv, ssm, meta)

    torch.testing.assert_close(run(ours), run(ref), **TIGHT)
    fused = ours.in_proj_fused
    assert fused is not None and ours.in_proj_ba.weight.data_ptr() > fused.data_ptr()
    assert ours.in_proj_qkvz.weight.data_ptr() == fused.data_ptr()
    assert ours.fuse_in_projections_() and ours.in_proj_fused is fused  # idempotent
    new_ba = torch.randn(8, 32, generator=gen)
    for layer in (ref, ours):  # a load after fusion (a weight update) lands in the fused GEMM
        layer.in_proj_ba.weight.copy_(new_ba)
    torch.testing.assert_close(run(ours), run(ref), **TIGHT)
    ours.in_proj_qkvz.weight.data = ours.in_proj_qkvz.weight.data.clone()
    assert ours.fuse_in_projections_() and ours.in_proj_fused is not fused  # re-joined
    torch.testing.assert_close(run(ours), run(ref), **TIGHT)
    assert not ref.fuse_in_projections_() and ref.in_proj_fused is None  # torch path: two
    ours.kernel_backend = "torch"  # switched after the join: the step drops it again
    assert not ours.fuse_in_projections_() and ours.in_proj_fused is None
    torch.testing.assert_close(run(ours), run(ref), **TIGHT)
    assert copy.deepcopy(ref).in_proj_fused is None


@torch.no_grad()
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "lens, carry, want_rows",
    [
        ((4, 1, 3), (True, True, True), [(0, 4, 5, 8)]),  # a verify step
        ((5, 4, 1, 3), (False, True, True, True), [(0, 4, 5, 8)]),  # after a fresh prefill
        ((40, 2), (True, True), [(0, 2)]),  # a chunk too long for the loop, then a row
        ((2, 6), (True, False), []),  # the last row starts fresh: the chunked rule for all
    ],
)
def test_short_continuing_rows_run_in_place_and_match_the_chunked_rule(
    backend: str,
    lens: tuple[int, ...],
    carry: tuple[bool, ...],
    want_rows: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of 1 + drafts tokens continuing their state (a verify step, then a decode) take
    the token-by-token in-place rule, the step's prefill chunks before them the chunked one;
    the step matches the chunked rule for every row (RECURRENT_ROWS_MAX_TOKENS = 0):
    outputs and both pools."""
    from tensorrt_llm._torch.modules import gated_delta_net_rows as rows_module

    ref = _layer(seed=2)
    ref.kernel_backend = "torch"
    ours = copy.deepcopy(ref).to(DEVICE)
    ours.kernel_backend = backend
    gen = torch.Generator().manual_seed(6)
    meta = _meta(lens, carry, decodes=1)
    slots = torch.tensor([4, 1, 3, 0, 5][: meta.num_seqs])
    conv_pool = torch.randn(6, *ref.conv_state_shape, generator=gen)
    ssm_pool = torch.randn(6, *ref.ssm_state_shape, generator=gen)
    x = torch.randn(meta.num_tokens, 32, generator=gen)
    calls: list[tuple[int, ...]] = []
    rows_rule = rows_module.gated_delta_rule_rows_

    def spy(*args, **kwargs):
        calls.append(args[7])
        return rows_rule(*args, **kwargs)

    monkeypatch.setattr(rows_module, "gated_delta_rule_rows_", spy)
    conv_d, ssm_d, s_d = conv_pool.clone().to(DEVICE), ssm_pool.clone().to(DEVICE), slots.to(DEVICE)
    got = ours(x.to(DEVICE), conv_d, ssm_d, meta, ssm_slots=s_d, conv_slots=s_d)
    assert calls == want_rows
    monkeypatch.setattr(rows_module, "RECURRENT_ROWS_MAX_TOKENS", 0)  # the chunked rule
    want = ref(x, conv_pool, ssm_pool, meta, ssm_slots=slots, conv_slots=slots)
    assert len(calls) == len(want_rows)
    torch.testing.assert_close(got.cpu(), want, **LAYER)
    torch.testing.assert_close(conv_d.cpu(), conv_pool, **TIGHT)
    torch.testing.assert_close(ssm_d.cpu(), ssm_pool, **LAYER)


@torch.no_grad()
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_replay_rows_equals_running_the_shorter_rows(backend: str) -> None:
    """A recorded verify step (rows of 4, 1 and 3 tokens after a fresh prefill chunk), then
    `replay_rows` keeping 2 and 1 of two rows' tokens from their states saved before the step
    (saved in another order than replayed; the pool rows are not put back first): their pool
    rows equal a step that ran just those tokens; the other rows keep the full step's."""
    from tensorrt_llm._torch.modules.gated_delta_net_rows import covers, replay_rows

    layer = _layer(seed=3).to(DEVICE)
    layer.kernel_backend = backend
    gen = torch.Generator().manual_seed(7)
    lens, carry = (5, 4, 1, 3), (False, True, True, True)
    slots = torch.tensor([2, 4, 1, 3])
    conv0 = torch.randn(6, *layer.conv_state_shape, generator=gen).to(DEVICE)
    ssm0 = torch.randn(6, *layer.ssm_state_shape, generator=gen).to(DEVICE)
    x = torch.randn(sum(lens), 32, generator=gen).to(DEVICE)
    record: list = []
    meta = GatedDeltaNetMetadata(lens, carry, record=record)
    conv, ssm, s_d = conv0.clone(), ssm0.clone(), slots.to(DEVICE)
    layer(x, conv, ssm, meta, ssm_slots=s_d, conv_slots=s_d)
    assert len(record) == 1 and record[0].first == 1 and record[0].lens == (4, 1, 3)
    assert covers(record, [1, 3], 1) and not covers(record, [0], 1)
    full_conv, full_ssm = conv.clone(), ssm.clone()
    back = torch.tensor([4, 3], device=DEVICE)  # the slots of rows 1 and 3
    saved_order = torch.tensor([3, 1, 4], device=DEVICE)  # slot 4 is saved row 2, slot 3 row 0
    saved = {conv.data_ptr(): conv0[saved_order], ssm.data_ptr(): ssm0[saved_order]}
    replay_rows(record, [(1, 2), (3, 1)], [4, 3], saved, [2, 0])
    # The reference: the two rows' kept tokens alone, from the states before the step.
    want_conv, want_ssm = conv0.clone(), ssm0.clone()
    short = GatedDeltaNetMetadata((2, 1), (True, True))
    kept = torch.cat([x[5:7], x[10:11]])
    layer(kept, want_conv, want_ssm, short, ssm_slots=back, conv_slots=back)
    torch.testing.assert_close(conv[back], want_conv[back], **TIGHT)
    torch.testing.assert_close(ssm[back], want_ssm[back], **LAYER)
    others = torch.tensor([0, 1, 2, 5], device=DEVICE)
    assert torch.equal(conv[others], full_conv[others]) and torch.equal(
        ssm[others], full_ssm[others]
    )
    with pytest.raises(ValueError, match="kept tokens"):
        replay_rows(record, [(2, 2)], [1], saved, [0])


@torch.no_grad()
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_replay_from_device_offsets_equals_host_offsets(backend: str) -> None:
    """`replay_layers` with its offsets a device vector and its token rows padded past them
    (the rollback graphs' static index: spec_decode/rollback_graphs.py) writes the same pool
    rows as `replay_rows` with host offsets."""
    from tensorrt_llm._torch.modules.gated_delta_net_rows import (
        ReplayIndex,
        replay_layers,
        replay_rows,
    )

    layer = _layer(seed=5).to(DEVICE)
    layer.kernel_backend = backend
    gen = torch.Generator().manual_seed(11)
    lens, carry = (4, 4, 4), (True, True, True)
    slots = torch.tensor([1, 3, 2], device=DEVICE)
    conv0 = torch.randn(5, *layer.conv_state_shape, generator=gen).to(DEVICE)
    ssm0 = torch.randn(5, *layer.ssm_state_shape, generator=gen).to(DEVICE)
    x = torch.randn(sum(lens), 32, generator=gen).to(DEVICE)
    record: list = []
    conv, ssm = conv0.clone(), ssm0.clone()
    layer(x, conv, ssm, GatedDeltaNetMetadata(lens, carry, record=record), slots, slots)
    after = conv.clone(), ssm.clone()
    saved = {conv.data_ptr(): conv0[slots], ssm.data_ptr(): ssm0[slots]}
    # Rows 0 and 2 keep 3 and 1 tokens; row 1 replays one token onto slot 4 (a dummy).
    replay_rows(record, [(0, 3), (2, 1), (1, 1)], [1, 2, 4], saved, [0, 2, 1])
    want = conv.clone(), ssm.clone()
    conv.copy_(after[0])
    ssm.copy_(after[1])

    def vec(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    index = ReplayIndex(
        tokens=vec([0, 1, 2, 4, 8] + [0] * 7),  # padded to all 12 recorded tokens
        slots=vec([1, 4, 2]),
        saved_rows=vec([0, 1, 2]),
        starts=vec([0, 4, 8]),
        keeps=vec([3, 1, 1]),
        cu=vec([0, 3, 4, 5]),
    )
    replay_layers(record, index, saved)
    assert torch.equal(conv, want[0]) and torch.equal(ssm, want[1])
