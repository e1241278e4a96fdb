"""Gated delta rule references and the Gated DeltaNet layer: naive-recurrence and HF parity,
chunked prefill with carried state, decode steps, mixed batches, fla on GPU."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from tensorrt_llm._torch.modules.gated_delta_net import (
    INPLACE_DECODE_ENV,
    GatedDeltaNet,
    GatedDeltaNetMetadata,
)
from tensorrt_llm._torch.modules.gated_delta_rule import (
    _call_fla,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    fla_available,
    fla_native_gva,
    fused_recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_ref,
)

HIDDEN = 32
LAYER_SIZES = dict(
    hidden_size=HIDDEN,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    intermediate_size=16,
    vocab_size=64,
)


# ----------------------------------------------------------------------------- the rule


def _naive_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state0: torch.Tensor,
    scale: float,
    l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ground truth in float64, one (batch, head, token) at a time."""
    q, k, v, g, beta, state = (x.double() for x in (q, k, v, g, beta, state0))
    batch, length, num_k_heads, _ = q.shape
    ratio = v.shape[2] // num_k_heads
    out = torch.zeros_like(v)
    state = state.clone()
    for b in range(batch):
        for h in range(v.shape[2]):
            s = state[b, h]
            for t in range(length):
                qt, kt = q[b, t, h // ratio], k[b, t, h // ratio]
                if l2norm:
                    qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                    kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                s = math.exp(g[b, t, h]) * s
                s = s + beta[b, t, h] * torch.outer(kt, v[b, t, h] - s.t() @ kt)
                out[b, t, h] = s.t() @ (qt * scale)
            state[b, h] = s
    return out, state


def _rule_inputs(
    batch: int, length: int, hk: int = 2, hv: int = 4, seed: int = 0, dk: int = 8, dv: int = 6
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, hk, dk, generator=gen)
    k = torch.randn(batch, length, hk, dk, generator=gen)
    v = torch.randn(batch, length, hv, dv, generator=gen)
    g = -torch.rand(batch, length, hv, generator=gen) * 1.5
    beta = torch.rand(batch, length, hv, generator=gen)
    state0 = torch.randn(batch, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state0


@pytest.mark.parametrize(
    "length,chunk_size,hk,l2norm",
    [(1, 64, 2, True), (19, 8, 2, True), (24, 8, 4, False), (37, 64, 1, True)],
)
def test_rule_references_match_naive_recurrence(
    length: int, chunk_size: int, hk: int, l2norm: bool
) -> None:
    q, k, v, g, beta, state0 = _rule_inputs(2, length, hk=hk)
    scale = 0.3
    want_o, want_s = _naive_rule(q, k, v, g, beta, state0, scale, l2norm)
    kw = dict(scale=scale, use_qk_l2norm=l2norm)
    for o, s in (
        chunk_gated_delta_rule_ref(q, k, v, g, beta, state0, True, chunk_size, **kw),
        recurrent_gated_delta_rule_ref(q, k, v, g, beta, state0, True, **kw),
    ):
        assert o.dtype == torch.float32 and s is not None and s.dtype == torch.float32
        torch.testing.assert_close(o.double(), want_o, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(s.double(), want_s, atol=2e-5, rtol=1e-5)


def test_rule_varlen_zero_state_and_dispatch() -> None:
    lens = [5, 12, 3]
    q, k, v, g, beta, state0 = _rule_inputs(1, sum(lens))
    state0 = state0.expand(3, -1, -1, -1) * torch.tensor([1.0, 0.5, -1.0])[:, None, None, None]
    cu = [0, 5, 17, 20]
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, state0, True, 4, cu_seqlens=cu)
    for n in range(3):
        span = slice(cu[n], cu[n + 1])
        args = (q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span])
        o_n, s_n = recurrent_gated_delta_rule_ref(*args, state0[n : n + 1], True)
        torch.testing.assert_close(o[:, span], o_n, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[n : n + 1], s_n, atol=1e-5, rtol=1e-5)
    # No initial state means zeros; no final state unless asked.
    o_zero, s_none = chunk_gated_delta_rule_ref(q, k, v, g, beta, None, False, cu_seqlens=cu)
    o_expl, _ = chunk_gated_delta_rule_ref(q, k, v, g, beta, state0 * 0, True, cu_seqlens=cu)
    assert s_none is None
    torch.testing.assert_close(o_zero, o_expl)
    # On CPU the dispatchers are the references.
    torch.testing.assert_close(
        chunk_gated_delta_rule(q, k, v, g, beta, state0[:1])[0],
        chunk_gated_delta_rule_ref(q, k, v, g, beta, state0[:1])[0],
    )
    torch.testing.assert_close(
        fused_recurrent_gated_delta_rule(q, k, v, g, beta)[0],
        recurrent_gated_delta_rule_ref(q, k, v, g, beta)[0],
    )


def test_fla_adapter_expands_heads_and_passes_offsets() -> None:
    """The fla call contract, checked on CPU with a stand-in for the kernel."""
    calls: list[torch.Tensor] = []

    # fla 0.6's fused recurrent signature: optional per-key/per-value gates sit between g and
    # beta, so an adapter passing beta positionally would hand it over as gk.
    def fake_fla(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None = None,
        gk: torch.Tensor | None = None,
        gv: torch.Tensor | None = None,
        beta: torch.Tensor | None = None,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert gk is None and gv is None, "beta or g reached fla's per-key/per-value gate slots"
        assert g is not None and beta is not None
        calls.append(cu_seqlens)
        assert q.shape[2] == k.shape[2] == v.shape[2] and g.dtype == torch.float32
        assert cu_seqlens.dtype == torch.long and initial_state.dtype == torch.float32
        return recurrent_gated_delta_rule_ref(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            output_final_state,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens.tolist(),
        )

    q, k, v, g, beta, state0 = _rule_inputs(1, 9, hk=1, hv=4)
    state0 = state0.expand(2, -1, -1, -1)
    kw = dict(scale=0.5, use_qk_l2norm=True, cu_seqlens=[0, 4, 9])
    o, s = _call_fla(fake_fla, q, k, v, g, beta, state0, True, **kw)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, state0, True, **kw)
    assert len(calls) == 1 and calls[0].tolist() == [0, 4, 9]
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(s, s_ref)


def test_fla_adapter_keeps_grouped_heads_for_a_native_fla() -> None:
    """An fla with grouped value heads gets q and k at their own head count (no Hv-head copies),
    and the result is the reference's (which maps value head i to q/k head i // r)."""
    seen: list[tuple[int, int]] = []

    def fake_chunk(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                   cu_seqlens_cpu=None):  # fmt: skip
        seen.append((q.shape[2], v.shape[2]))
        return chunk_gated_delta_rule_ref(
            q, k, v, g, beta, initial_state, output_final_state, scale=scale,
            use_qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens.tolist(),
        )  # fmt: skip

    q, k, v, g, beta, state0 = _rule_inputs(1, 9, hk=2, hv=6)
    state0 = state0.expand(2, -1, -1, -1)
    kw = dict(scale=None, use_qk_l2norm=True, cu_seqlens=[0, 4, 9])
    for expand in (False, True):
        o, s = _call_fla(fake_chunk, q, k, v, g, beta, state0, True, **kw, expand_heads=expand)
        o_ref, s_ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, state0, True, **kw)
        torch.testing.assert_close(o, o_ref)
        torch.testing.assert_close(s, s_ref)
    assert seen == [(2, 6), (6, 6)]


@pytest.mark.parametrize(
    ("version", "native"),
    [("0.6.0", True), ("0.4.0", True), ("1.0.0rc1", True), ("0.3.2", False), ("0", False),
     ("0.2.2.dev5", False), ("unknown", False)],
)  # fmt: skip
def test_fla_native_gva_by_version(version: str, native: bool) -> None:
    assert fla_native_gva(version) is native


def test_fla_chunk_calls_of_one_step_share_offset_tensors() -> None:
    """Every layer of a step passes equal cu_seqlens: fla must get the very same device tensor
    (its per-tensor cache then plans chunks once per step) plus the host copy."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fake_chunk(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                   cu_seqlens_cpu=None):  # fmt: skip
        seen.append((cu_seqlens, cu_seqlens_cpu))
        return recurrent_gated_delta_rule_ref(
            q, k, v, g, beta, initial_state, output_final_state, scale=scale,
            use_qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens.tolist(),
        )  # fmt: skip

    q, k, v, g, beta, _ = _rule_inputs(1, 9, hk=1, hv=2)
    for cu in ([0, 4, 9], [0, 4, 9], [0, 2, 9]):
        _call_fla(fake_chunk, q, k, v, g, beta, None, True, scale=None, use_qk_l2norm=True,
                  cu_seqlens=cu, pass_host_offsets=True)  # fmt: skip
    assert seen[0][0] is seen[1][0] and seen[0][1] is seen[1][1]
    assert seen[2][0] is not seen[0][0] and seen[2][1].tolist() == [0, 2, 9]
    assert seen[0][1].tolist() == [0, 4, 9] and seen[0][0].dtype == torch.long


def test_rule_bad_inputs_raise() -> None:
    q, k, v, g, beta, state0 = _rule_inputs(2, 6)
    with pytest.raises(ValueError, match="cu_seqlens needs batch size 1"):
        chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens=[0, 6])
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_gated_delta_rule_ref(q, k, v, g, beta, state0[:1])
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        recurrent_gated_delta_rule_ref(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="cu_seqlens must run"):
        chunk_gated_delta_rule_ref(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=[0, 4])


# ----------------------------------------------------------------------------- the layer


def _hf_and_ours(
    kind: str = "qwen3_5", seed: int = 0, **sizes: int
) -> tuple[torch.nn.Module, GatedDeltaNet]:
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        config = Qwen3_5TextConfig(**{**LAYER_SIZES, **sizes})
        hf: torch.nn.Module = Qwen3_5GatedDeltaNet(config, 0)
    else:
        config = Qwen3NextConfig(**LAYER_SIZES, num_experts=4, num_experts_per_tok=2)
        hf = Qwen3NextGatedDeltaNet(config, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = GatedDeltaNet.from_config(config)
    ours.load_weights(hf.state_dict())
    return hf.eval(), ours.eval()


def _states(layer: GatedDeltaNet, n: int, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((n, *layer.conv_state_shape), fill),
        torch.full((n, *layer.ssm_state_shape), fill),
    )


def _meta(
    lens: Sequence[int] = (), carry: Sequence[bool] = (), decodes: int = 0
) -> GatedDeltaNetMetadata:
    return GatedDeltaNetMetadata(tuple(lens), tuple(carry), decodes)


@torch.no_grad()
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
@pytest.mark.parametrize("inplace_decode", [False, True])
def test_pool_rows_by_slot_match_per_request_states(
    device: str, inplace_decode: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ssm_slots` mode (the model's pool, rows addressed by seq slot, read and written in
    place) gives the same outputs and final states as gathered per-request tensors, and
    leaves every other pool row alone; with the in-place decode kernel (the default: Triton
    on CUDA, its torch path on the CPU) and with gather -> step -> scatter (env "0")."""
    monkeypatch.setenv(INPLACE_DECODE_ENV, "1" if inplace_decode else "0")
    _, ours = _hf_and_ours(linear_key_head_dim=16, linear_value_head_dim=16)
    gen = torch.Generator().manual_seed(9)
    pool = torch.randn(6, *ours.ssm_state_shape, generator=gen)
    slots = torch.tensor([4, 1, 3])
    steps = [(_meta([5, 3], [False, True], decodes=1), 9), (_meta(decodes=3), 3)]
    conv, _ = _states(ours, 3, fill=0.5)
    conv_ref, ssm_ref = conv.clone(), pool[slots].clone()
    untouched = pool[[0, 2, 5]].clone()
    layer = copy.deepcopy(ours).to(device)
    conv, pool, slots_d = conv.to(device), pool.to(device), slots.to(device)
    tol = dict(atol=1e-2, rtol=1e-2) if device == "cuda" else dict(atol=1e-5, rtol=1e-5)
    for meta, tokens in steps:
        x = torch.randn(tokens, HIDDEN, generator=gen)
        want = ours(x, conv_ref, ssm_ref, meta)
        got = layer(x.to(device), conv, pool, meta, ssm_slots=slots_d)
        torch.testing.assert_close(got.cpu(), want, **tol)
        torch.testing.assert_close(pool.cpu()[slots], ssm_ref, **tol)
        torch.testing.assert_close(conv.cpu(), conv_ref, **tol)
    assert torch.equal(pool.cpu()[[0, 2, 5]], untouched)
    with pytest.raises(ValueError, match="ssm_slots must be"):
        layer(x.to(device), conv, pool, steps[1][0], ssm_slots=slots_d[:2])


@torch.no_grad()
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_prefill_matches_hf(kind: str) -> None:
    hf, ours = _hf_and_ours(kind)
    x = torch.randn(1, 70, HIDDEN)  # more than one 64-token chunk
    conv, ssm = _states(ours, 1, fill=3.0)  # stale slot contents are ignored
    out = ours(x[0], conv, ssm, _meta([70], [False]))
    torch.testing.assert_close(out, hf(x)[0], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_chunked_prefill_in_three_chunks_equals_one_pass() -> None:
    hf, ours = _hf_and_ours()
    x = torch.randn(150, HIDDEN)
    conv_1, ssm_1 = _states(ours, 1)
    full = ours(x, conv_1, ssm_1, _meta([150], [False]))
    torch.testing.assert_close(full, hf(x[None])[0], atol=1e-5, rtol=1e-4)
    conv, ssm = _states(ours, 1, fill=-2.0)
    outs = []
    for i, (lo, hi) in enumerate([(0, 40), (40, 110), (110, 150)]):
        outs.append(ours(x[lo:hi], conv, ssm, _meta([hi - lo], [i > 0])))
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(conv, conv_1)
    torch.testing.assert_close(ssm, ssm_1, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_prefill_then_decode_steps_equal_longer_prefill() -> None:
    hf, ours = _hf_and_ours()
    lens, total = (9, 5), 14
    xs = [torch.randn(total, HIDDEN) for _ in lens]
    refs = [hf(x[None])[0] for x in xs]
    conv, ssm = _states(ours, 2, fill=1.0)
    out = ours(
        torch.cat([x[:n] for x, n in zip(xs, lens, strict=True)]),
        conv,
        ssm,
        _meta(lens, [False] * 2),
    )
    torch.testing.assert_close(out[: lens[0]], refs[0][: lens[0]], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[lens[0] :], refs[1][: lens[1]], atol=1e-5, rtol=1e-4)
    # Request 0 still has 5 tokens to go, request 1 has 9: decode them side by side.
    steps = [0, 0]
    for _ in range(5):
        pos = [lens[r] + steps[r] for r in range(2)]
        step = ours(torch.stack([xs[r][pos[r]] for r in range(2)]), conv, ssm, _meta(decodes=2))
        for r in range(2):
            torch.testing.assert_close(step[r], refs[r][pos[r]], atol=1e-5, rtol=1e-4)
            steps[r] += 1


@torch.no_grad()
def test_mixed_step_context_and_decode_rows() -> None:
    """One step: a fresh context request, a continuing chunk, then two decodes."""
    hf, ours = _hf_and_ours(seed=1)
    xs = [torch.randn(12, HIDDEN) for _ in range(4)]
    refs = [hf(x[None])[0] for x in xs]
    conv, ssm = _states(ours, 4, fill=5.0)
    # Bring requests 1..3 to their starting points one at a time (rows 1..3 of the state).
    done = {1: 4, 2: 7, 3: 11}
    for row, n in done.items():
        c, s = conv[row : row + 1], ssm[row : row + 1]
        ours(xs[row][:n], c, s, _meta([n], [False]))
    step_x = torch.cat([xs[0][:6], xs[1][4:10], xs[2][7:8], xs[3][11:12]])
    out = ours(step_x, conv, ssm, _meta([6, 6], [False, True], decodes=2))
    want = torch.cat([refs[0][:6], refs[1][4:10], refs[2][7:8], refs[3][11:12]])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


def test_layer_bad_inputs_raise() -> None:
    _, ours = _hf_and_ours()
    conv, ssm = _states(ours, 1)
    x = torch.randn(5, HIDDEN)
    with pytest.raises(ValueError, match="tokens but the metadata"):
        ours(x, conv, ssm, _meta([4], [False]))
    with pytest.raises(ValueError, match="ssm_states must be"):
        ours(x, conv, ssm[:, :2], _meta([5], [False]))
    with pytest.raises(ValueError, match="conv_states must be"):
        ours(x, conv.expand(2, -1, -1), ssm, _meta([5], [False]))
    with pytest.raises(ValueError, match="has_initial_state has"):
        GatedDeltaNetMetadata((5,), (), 0)
    with pytest.raises(ValueError, match="positive"):
        GatedDeltaNetMetadata((0,), (False,), 0)
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        ours.load_weights({"in_proj_qkvz.weight": torch.zeros(3, HIDDEN)})
    with pytest.raises(ValueError, match="missing"):
        ours.load_weights({})


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not fla_available(), reason="fla (flash-linear-attention) is not installed")
def test_fla_matches_reference() -> None:
    cu = [0, 37, 100, 101]
    # Head dims of 32: Triton's dot products want tiles of at least 16.
    q, k, v, g, beta, _ = _rule_inputs(1, cu[-1], hk=2, hv=4, dk=32, dv=32)
    state0 = torch.randn(3, 4, 32, 32)
    dev = [x.cuda() for x in (q, k, v, g, beta, state0)]
    for fn, ref in (
        (chunk_gated_delta_rule, chunk_gated_delta_rule_ref),
        (fused_recurrent_gated_delta_rule, recurrent_gated_delta_rule_ref),
    ):
        o, s = fn(*dev, True, use_qk_l2norm=True, cu_seqlens=cu)
        o_ref, s_ref = ref(q, k, v, g, beta, state0, True, use_qk_l2norm=True, cu_seqlens=cu)
        torch.testing.assert_close(o.cpu().float(), o_ref, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(s.cpu().float(), s_ref, atol=1e-2, rtol=1e-2)
    # Batched decode as the model runs it: one token per request, no cu_seqlens.
    q, k, v, g, beta, state0 = _rule_inputs(5, 1, hk=2, hv=4, dk=32, dv=32, seed=1)
    dev = [x.cuda() for x in (q, k, v, g, beta, state0)]
    o, s = fused_recurrent_gated_delta_rule(*dev, True, use_qk_l2norm=True)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(
        q, k, v, g, beta, state0, True, use_qk_l2norm=True
    )
    torch.testing.assert_close(o.cpu().float(), o_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(s.cpu().float(), s_ref, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@torch.no_grad()
def test_layer_on_cuda_matches_cpu_and_decode_graph_replays() -> None:
    _, ours = _hf_and_ours(linear_key_head_dim=32, linear_value_head_dim=32)
    x = torch.randn(41, HIDDEN)
    prefill, decode = _meta([20, 19], [False, False]), _meta(decodes=2)
    conv, ssm = _states(ours, 2)
    want_prefill = ours(x[:39], conv, ssm, prefill)
    want_decode = ours(x[39:], conv, ssm, decode)
    gpu = ours.cuda()
    conv_d, ssm_d = (t.cuda() for t in _states(ours, 2))
    x_d = x.cuda()
    got = gpu(x_d[:39], conv_d, ssm_d, prefill)
    torch.testing.assert_close(got.cpu(), want_prefill, atol=1e-2, rtol=1e-2)
    # Decode must be capturable: warm up on copies, capture (which runs nothing), replay once.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gpu(x_d[39:], conv_d.clone(), ssm_d.clone(), decode)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu(x_d[39:], conv_d, ssm_d, decode)
    graph.replay()
    torch.testing.assert_close(out.cpu(), want_decode, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ssm_d.cpu(), ssm, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(conv_d.cpu(), conv, atol=1e-5, rtol=1e-5)
