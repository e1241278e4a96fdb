"""In-place gated-delta-rule decode (Triton) against the token-by-token torch reference.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.modules.gated_delta_rule import recurrent_gated_delta_rule_ref
from tensorrt_llm._torch.modules.triton_kernels.gdn_decode import (
    gated_delta_rule_decode_,
    gated_delta_rule_rows_,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n: int, hk: int, hv: int, dk: int, dv: int, pool_rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hk, dk, generator=gen)
    k = torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen)
    pool = torch.randn(pool_rows, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, pool


def _reference(q, k, v, g, beta, pool, slots, scale, l2):
    o, final = recurrent_gated_delta_rule_ref(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], pool[slots], True,
        scale=scale, use_qk_l2norm=l2,
    )  # fmt: skip
    return o[:, 0], final


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("l2", [True, False])
def test_decode_updates_pool_rows_in_place(backend: str, l2: bool) -> None:
    # V = 48 is not a multiple of the 32-column program tile; heads are grouped 2:1.
    q, k, v, g, beta, pool = _inputs(3, 2, 4, 16, 48, pool_rows=6)
    slots = torch.tensor([4, 1, 3])
    want_o, want_state = _reference(q, k, v, g, beta, pool, slots, 0.3, l2)
    untouched = pool[[0, 2, 5]].clone()
    dev = [t.to(DEVICE) for t in (q, k, v, g, beta, pool, slots)]
    got = gated_delta_rule_decode_(*dev, scale=0.3, use_qk_l2norm=l2, backend=backend)
    torch.testing.assert_close(got.cpu(), want_o, atol=1e-5, rtol=1e-5)
    pool_after = dev[5].cpu()
    torch.testing.assert_close(pool_after[slots], want_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool_after[[0, 2, 5]], untouched)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [False, True])
def test_16bit_pool_computes_in_float32_and_rounds_once(dtype: torch.dtype, rows: bool) -> None:
    """A 16-bit state pool (`mamba_ssm_cache_dtype`): the state is read into float32, a row's
    tokens all run in float32, and the pool gets the result rounded once: the float32
    reference from the upcast pool, cast to the pool's dtype. The interpreter truncates
    float32 -> bf16, so that case is held to one bf16 step."""
    lens = (3, 1) if rows else (1, 1)
    total = sum(lens)
    q, k, v, g, beta, pool = _inputs(total, 2, 4, 16, 48, pool_rows=5, seed=6)
    pool = pool.to(dtype)
    slots = torch.tensor([3, 0])
    cu = (0, *torch.tensor(lens).cumsum(0).tolist())
    want_o, finals = recurrent_gated_delta_rule_ref(
        q[None], k[None], v[None], g[None], beta[None], pool[slots].float(), True,
        use_qk_l2norm=True, cu_seqlens=cu,
    )  # fmt: skip
    assert finals is not None
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-3)
    for backend in ("torch", "triton"):
        dev = [t.to(DEVICE) for t in (q, k, v, g, beta, pool.clone(), slots)]
        if rows:
            got = gated_delta_rule_rows_(*dev, cu, backend=backend)
        else:
            got = gated_delta_rule_decode_(*dev, backend=backend)
        after = dev[5].cpu()
        assert after.dtype == dtype
        torch.testing.assert_close(got.cpu(), want_o[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(after[slots].float(), finals.to(dtype).float(), **tol)
        assert torch.equal(after[[1, 2, 4]], pool[[1, 2, 4]])


def test_strided_inputs_and_bad_shapes() -> None:
    """q/k/v as views of one packed projection (the layer's layout), then argument checks."""
    n, hk, hv, dk, dv = 2, 1, 2, 16, 16
    packed = torch.randn(n, 2 * hk * dk + hv * dv)
    q = packed[:, :dk].view(n, hk, dk)
    k = packed[:, dk : 2 * dk].view(n, hk, dk)
    v = packed[:, 2 * dk :].view(n, hv, dv)
    _, _, _, g, beta, pool = _inputs(n, hk, hv, dk, dv, pool_rows=3)
    slots = torch.tensor([2, 0])
    want_o, want_state = _reference(q, k, v, g, beta, pool, slots, None, True)
    got = gated_delta_rule_decode_(q, k, v, g, beta, pool, slots, backend="triton")
    torch.testing.assert_close(got, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], want_state, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="slots must be"):
        gated_delta_rule_decode_(q, k, v, g, beta, pool, slots[:1])
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rule_decode_(q, k, v, g, beta, pool.double(), slots)
    with pytest.raises(ValueError, match="state_pool must be"):
        gated_delta_rule_decode_(q, k, v, g, beta, pool[:, :1], slots)


@pytest.mark.gpu
def test_gpu_qwen3_6_sizes_bf16_match_torch_path() -> None:
    """Qwen3.6-27B DeltaNet heads (16 k / 48 v of 128) in bf16, 32 requests, pool of 40."""
    q, k, v, g, beta, pool = (t.cuda() for t in _inputs(32, 16, 48, 128, 128, pool_rows=40))
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))
    slots = torch.randperm(40, device="cuda")[:32]
    pool_ref = pool.clone()
    want = gated_delta_rule_decode_(q, k, v, g, beta, pool_ref, slots, backend="torch")
    got = gated_delta_rule_decode_(q, k, v, g, beta, pool, slots, backend="triton")
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(pool, pool_ref, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_bf16_pool_matches_torch_path() -> None:
    """A bfloat16 state pool at Qwen3.6-35B-A3B heads (16 k / 32 v of 128), 128 requests:
    the kernel's once-a-step rounding against the torch path's."""
    q, k, v, g, beta, pool = (t.cuda() for t in _inputs(128, 16, 32, 128, 128, pool_rows=130))
    q, k, v, beta, pool = (t.bfloat16() for t in (q, k, v, beta, pool))
    slots = torch.randperm(130, device="cuda")[:128]
    pool_ref = pool.clone()
    want = gated_delta_rule_decode_(q, k, v, g, beta, pool_ref, slots, backend="torch")
    got = gated_delta_rule_decode_(q, k, v, g, beta, pool, slots, backend="triton")
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(pool.float(), pool_ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("raw_gates", [False, True])
def test_rows_equal_decode_steps_one_token_at_a_time(backend: str, raw_gates: bool) -> None:
    """Rows of 4, 1 and 3 tokens (a verify step: 1 + drafts each) run in one call leave the
    pool and give the outputs of decoding each row's tokens in turn."""
    lens = (4, 1, 3)
    slots = torch.tensor([4, 1, 3])
    total = sum(lens)
    q, k, v, g, beta, pool = _inputs(total, 2, 4, 16, 48, pool_rows=6, seed=3)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(total, 4, generator=gen), torch.randn(total, 4, generator=gen)
    a_log, dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    gates = (a, b, a_log, dt_bias) if raw_gates else None
    cu = (0, 4, 5, 8)
    # The reference: decode one token of every row still running, step by step.
    want_pool, want_o = pool.clone(), torch.empty_like(v)
    for step in range(max(lens)):
        rows = [n for n, length in enumerate(lens) if step < length]
        toks = torch.tensor([cu[n] + step for n in rows])
        gg = (a[toks], b[toks], a_log, dt_bias) if raw_gates else None
        g_t, b_t = (None, None) if raw_gates else (g[toks], beta[toks])
        want_o[toks] = gated_delta_rule_decode_(
            q[toks], k[toks], v[toks], g_t, b_t, want_pool, slots[rows], scale=0.3,
            backend="torch", gates=gg,
        )  # fmt: skip
    dev = [t.to(DEVICE) for t in (q, k, v, g, beta, pool, slots)]
    dev_gates = tuple(t.to(DEVICE) for t in gates) if gates is not None else None
    g_arg, b_arg = (None, None) if raw_gates else (dev[3], dev[4])
    got = gated_delta_rule_rows_(
        dev[0], dev[1], dev[2], g_arg, b_arg, dev[5], dev[6], cu, scale=0.3,
        backend=backend, gates=dev_gates,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dev[5].cpu(), want_pool, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="increasing"):
        gated_delta_rule_rows_(*dev[:5], dev[5], dev[6], (0, 4, 4, 8), backend=backend)
    with pytest.raises(ValueError, match="slots must be"):
        gated_delta_rule_rows_(*dev[:5], dev[5], dev[6][:2], cu, backend=backend)


@pytest.mark.gpu
def test_gpu_rows_at_qwen3_6_sizes_match_decode_steps() -> None:
    """32 verify rows of 4 tokens (Qwen3.6-27B heads, bf16) against 4 decode steps."""
    n, t = 32, 4
    q, k, v, g, beta, pool = (t_.cuda() for t_ in _inputs(n * t, 16, 48, 128, 128, 40, seed=5))
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    slots = torch.randperm(40, device="cuda")[:n]
    want_pool, want = pool.clone(), torch.empty_like(v)
    for step in range(t):
        toks = torch.arange(n, device="cuda") * t + step
        want[toks] = gated_delta_rule_decode_(
            q[toks], k[toks], v[toks], g[toks], beta[toks], want_pool, slots, backend="triton"
        )
    cu = tuple(range(0, n * t + 1, t))
    got = gated_delta_rule_rows_(q, k, v, g, beta, pool, slots, cu, backend="triton")
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(pool, want_pool, atol=1e-4, rtol=1e-4)
