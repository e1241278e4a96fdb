"""The gated delta rule: the torch references against a naive float64 recurrence, the fla
adapter's call contract (head expansion or grouped value heads, shared offsets), and fla's
kernels against the references on GPU. The layer built on it: test_gated_delta_net.py."""

from __future__ import annotations

import math

import pytest
import torch

from tensorrt_llm._torch.modules.gated_delta_rule import (
    _call_fla,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    fla_available,
    fla_native_gva,
    fused_recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_ref,
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
