"""One decode step of the gated delta rule, with the recurrent state updated in place in its pool.

fla's fused recurrent kernel takes the states of the batch as one contiguous input and returns
the final states as a new tensor, so a serving engine that keeps states in a per-seq-slot pool
pays a gather before and a scatter after: with Qwen3.6-27B at 32 requests that is ~0.6 GB of
extra traffic per DeltaNet layer and step. Here each program reads its slice of the state
straight from `pool[slots[n], hv]`, applies the step and writes it back, so the state crosses
HBM once in each direction.

Per request n and value head hv (q/k head h = hv // (Hv / Hk)), with the state S: [K, V]:
    q, k <- l2norm(q), l2norm(k);   q <- scale * q
    S <- exp(g) * S;   u = beta * (v - S^T k);   S <- S + k u^T;   o = S^T q
which is `recurrent_gated_delta_rule_ref` for one token.
NOTE: no host sync and shapes only, so decode CUDA graphs can capture it; padded graph rows
must carry a dummy slot (their states are garbage and never read by a real request).
"""

from __future__ import annotations

import torch

from . import tl, triton, triton_jit, use_triton

# Same eps as `gated_delta_rule.l2_normalize` (fla and HF use it too).
_L2_EPS = 1e-6
# Value columns per program: the [K, BLOCK_V] float32 state slice lives in registers.
_BLOCK_V = 32


@triton_jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_gn, stride_bn, stride_on, stride_oh,
    stride_sp, stride_sh, stride_sk,
    scale, eps,
    RATIO: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    h = hv // RATIO
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < K
    mv = offs_v < V
    q = tl.load(q_ptr + n * stride_qn + h * stride_qh + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + n * stride_kn + h * stride_kh + offs_k, mask=mk, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, 0) + eps)
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + eps)
    q = q * scale
    v = tl.load(v_ptr + n * stride_vn + hv * stride_vh + offs_v, mask=mv, other=0.0)
    g = tl.load(g_ptr + n * stride_gn + hv).to(tl.float32)
    beta = tl.load(beta_ptr + n * stride_bn + hv).to(tl.float32)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    s_ptrs = (
        state_ptr + slot * stride_sp + hv * stride_sh
        + offs_k[:, None] * stride_sk + offs_v[None, :]
    )  # fmt: skip
    s_mask = mk[:, None] & mv[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0) * tl.exp(g)
    predicted = tl.sum(state * k[:, None], 0)
    update = beta * (v.to(tl.float32) - predicted)
    state = state + k[:, None] * update[None, :]
    out = tl.sum(state * q[:, None], 0)
    tl.store(s_ptrs, state, mask=s_mask)
    tl.store(o_ptr + n * stride_on + hv * stride_oh + offs_v, out.to(v.dtype), mask=mv)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must be [N, Hk, K] and equal, got {q.shape} and {k.shape}")
    n, num_k_heads, head_k = q.shape
    if v.dim() != 3 or v.shape[0] != n or v.shape[1] % num_k_heads != 0:
        raise ValueError(
            f"v must be [{n}, Hv, V] with Hv a multiple of {num_k_heads}, got {v.shape}"
        )
    num_v_heads, head_v = v.shape[1], v.shape[2]
    if g.shape != (n, num_v_heads) or beta.shape != (n, num_v_heads):
        raise ValueError(f"g and beta must be [{n}, {num_v_heads}], got {g.shape}, {beta.shape}")
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (num_v_heads, head_k, head_v):
        raise ValueError(
            f"state_pool must be [P, {num_v_heads}, {head_k}, {head_v}], got {state_pool.shape}"
        )
    if state_pool.dtype != torch.float32 or state_pool.stride(-1) != 1:
        raise ValueError("state_pool must be float32 and contiguous in its last dimension")
    if slots.shape != (n,):
        raise ValueError(f"slots must be [{n}], got {tuple(slots.shape)}")


def _decode_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    # Imported here: gated_delta_rule imports the kernels package, not the other way round.
    from ..gated_delta_rule import recurrent_gated_delta_rule_ref

    initial = state_pool.index_select(0, slots)
    o, final = recurrent_gated_delta_rule_ref(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial, True,
        scale=scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
    assert final is not None
    state_pool.index_copy_(0, slots, final)
    return o[:, 0]


def gated_delta_rule_decode_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """One token per request: `q, k: [N, Hk, K]`, `v: [N, Hv, V]`, `g, beta: [N, Hv]` (g is
    the log-decay); request n's state is `state_pool[slots[n]]` (`[P, Hv, K, V]`, float32),
    updated in place. Returns `o: [N, Hv, V]` in v's dtype."""
    _check(q, k, v, g, beta, state_pool, slots)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not use_triton("gated_delta_rule_decode_", q.device, backend):
        return _decode_torch(q, k, v, g, beta, state_pool, slots, scale, use_qk_l2norm)
    n, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    out = torch.empty_like(v)
    if n == 0:
        return out
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    block_v = min(_BLOCK_V, triton.next_power_of_2(head_v))
    _gdn_decode_kernel[(n, num_v_heads, triton.cdiv(head_v, block_v))](
        q, k, v, g, beta, out, state_pool, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        scale, _L2_EPS,
        RATIO=num_v_heads // num_k_heads, K=head_k, V=head_v,
        BLOCK_K=triton.next_power_of_2(head_k), BLOCK_V=block_v, L2NORM=use_qk_l2norm,
    )  # fmt: skip
    return out
