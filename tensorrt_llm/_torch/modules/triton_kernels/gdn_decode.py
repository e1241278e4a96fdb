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
which is `recurrent_gated_delta_rule_ref` for one token. A 16-bit pool is read into float32
and rounded once when written back.
With `gates=(a, b, A_log, dt_bias)` instead of g and beta, each program also forms its head's
    beta = sigmoid(b),   g = -exp(A_log) * softplus(a + dt_bias)
(rounded as `GatedDeltaNet`'s torch path: beta in b's dtype, g in float32), which saves the
~8 small torch kernels of the gates per layer and decode step.
NOTE: no host sync and shapes only, so decode CUDA graphs can capture it; padded graph rows
must carry a dummy slot (their states are garbage and never read by a real request).
"""

from __future__ import annotations

import torch

from ...._utils import step_constant
from . import pdl_launch_kwargs, pdl_sync, tl, triton, triton_jit, use_triton

# Same eps as `gated_delta_rule.l2_normalize` (fla and HF use it too).
_L2_EPS = 1e-6
# State pool element types: float32 (the default), or 16-bit where the user chose half the
# state bytes (`mamba_ssm_cache_dtype`); the kernel computes in float32 either way.
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Value columns per program: the [K, BLOCK_V] float32 state slice lives in registers. From
# `bench_gdn.py` on the H200 (27B dims): 64 columns are 11% faster than 32 at batch 64 (111.7
# vs 125.4 us: longer contiguous runs of each state row) and equal at batch 16; small grids
# keep 32 so that more programs share the SMs (the prompt-end rows loop is sequential in
# tokens). `_BLOCK_V` set to a number forces it (the benchmark's sweep).
_BLOCK_V: int | None = None
# Warps per program (Triton's default 4); set to a number it forces them (the sweep).
_NUM_WARPS: int | None = None
_WIDE_MIN_HEAD_ROWS = 1024  # requests x value heads from which 64 columns are used


def _block_v(rows: int, num_v_heads: int, head_v: int) -> int:
    wide = 64 if rows * num_v_heads >= _WIDE_MIN_HEAD_ROWS else 32
    return min(_BLOCK_V or wide, triton.next_power_of_2(head_v))


@triton_jit
def _gdn_token(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, t, h, hv,
    offs_k, offs_v, mk, mv,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_bn,
    scale, eps, L2NORM: tl.constexpr, RAW_GATES: tl.constexpr,
):  # fmt: skip
    """Token t's (q, k, v, g, beta) of head hv, in float32 (q scaled, both l2-normed)."""
    q = tl.load(q_ptr + t * stride_qn + h * stride_qh + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t * stride_kn + h * stride_kh + offs_k, mask=mk, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, 0) + eps)
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + eps)
    q = q * scale
    v = tl.load(v_ptr + t * stride_vn + hv * stride_vh + offs_v, mask=mv, other=0.0)
    if RAW_GATES:
        # g_ptr / beta_ptr hold the raw projections a and b here.
        a = tl.load(g_ptr + t * stride_gn + hv).to(tl.float32)
        a = a + tl.load(dt_bias_ptr + hv).to(tl.float32)
        # torch's softplus (threshold 20), in float32
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        g = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus
        b = tl.load(beta_ptr + t * stride_bn + hv)
        beta = tl.sigmoid(b.to(tl.float32)).to(beta_ptr.dtype.element_ty).to(tl.float32)
    else:
        g = tl.load(g_ptr + t * stride_gn + hv).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bn + hv).to(tl.float32)
    return q, k, v, g, beta


@triton_jit
def _gdn_step(state, q, k, v, g, beta):
    """One token of the rule on a [K, BLOCK_V] float32 state slice: (new state, output)."""
    state = state * tl.exp(g)
    predicted = tl.sum(state * k[:, None], 0)
    update = beta * (v.to(tl.float32) - predicted)
    state = state + k[:, None] * update[None, :]
    return state, tl.sum(state * q[:, None], 0)


@triton_jit(do_not_specialize=("use_index", "use_init"))
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr, cu_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_gn, stride_bn, stride_on, stride_oh,
    stride_sp, stride_sh, stride_sk,
    a_log_ptr, dt_bias_ptr, tok_ptr, init_ptr, init_rows_ptr, stride_ip, stride_ih, stride_ik,
    scale, eps, use_index, use_init,
    RATIO: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
    RAW_GATES: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # ROWS: program n runs tokens cu[n]..cu[n + 1] of its request in order (verify rows of a
    # speculative step); else token n only, its loads issued before the state's.
    # ROWS with use_index: packed token t reads the inputs' row tok[t] (a replay reads the
    # verify step's recorded rows in place); with use_init: the state starts from
    # init[init_rows[n]] (a saved copy) instead of the pool row, which it still ends in. Both
    # are runtime flags, so a replay runs the verify rows' compiled variant.
    pdl_sync(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    h = hv // RATIO
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < K
    mv = offs_v < V
    slot = tl.load(slots_ptr + n).to(tl.int64)
    s_ptrs = (
        state_ptr + slot * stride_sp + hv * stride_sh
        + offs_k[:, None] * stride_sk + offs_v[None, :]
    )  # fmt: skip
    s_mask = mk[:, None] & mv[None, :]
    if ROWS:
        if use_init != 0:
            row = tl.load(init_rows_ptr + n).to(tl.int64)
            i_ptrs = (
                init_ptr + row * stride_ip + hv * stride_ih
                + offs_k[:, None] * stride_ik + offs_v[None, :]
            )  # fmt: skip
            state = tl.load(i_ptrs, mask=s_mask, other=0.0).to(tl.float32)
        else:
            state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
        begin = tl.load(cu_ptr + n).to(tl.int64)
        end = tl.load(cu_ptr + n + 1).to(tl.int64)
        for t in range(begin, end):
            if use_index != 0:
                src = tl.load(tok_ptr + t).to(tl.int64)
            else:
                src = t
            q, k, v, g, beta = _gdn_token(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, src, h, hv,
                offs_k, offs_v, mk, mv,
                stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                stride_gn, stride_bn, scale, eps, L2NORM, RAW_GATES,
            )  # fmt: skip
            state, out = _gdn_step(state, q, k, v, g, beta)
            tl.store(o_ptr + t * stride_on + hv * stride_oh + offs_v, out.to(v.dtype), mask=mv)
    else:
        q, k, v, g, beta = _gdn_token(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, n, h, hv,
            offs_k, offs_v, mk, mv,
            stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
            stride_gn, stride_bn, scale, eps, L2NORM, RAW_GATES,
        )  # fmt: skip
        state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
        state, out = _gdn_step(state, q, k, v, g, beta)
        tl.store(o_ptr + n * stride_on + hv * stride_oh + offs_v, out.to(v.dtype), mask=mv)
    # A 16-bit pool is rounded here, once a step (a row's tokens run in float32 in between).
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    num_rows: int | None = None,
) -> None:
    """Shapes of T tokens (`[T, ...]`) run for `num_rows` requests (None: T, one token each)."""
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
    if state_pool.dtype not in STATE_DTYPES or state_pool.stride(-1) != 1:
        raise ValueError(
            f"state_pool must be one of {[str(d) for d in STATE_DTYPES]} and contiguous in its "
            f"last dimension, got {state_pool.dtype}"
        )
    rows = n if num_rows is None else num_rows
    if slots.shape != (rows,):
        raise ValueError(f"slots must be [{rows}], got {tuple(slots.shape)}")


def _recurrent_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    cu_seqlens: tuple[int, ...] | None,
    initial_from: InitialStates | None = None,
) -> torch.Tensor:
    """The reference: each request's tokens in turn from its pool row (or its saved copy in
    `initial_from`), written back to the pool row."""
    # Imported here: gated_delta_rule imports the kernels package, not the other way round.
    from ..gated_delta_rule import recurrent_gated_delta_rule_ref

    if initial_from is None:
        initial = state_pool.index_select(0, slots)
    else:
        initial = initial_from[0].index_select(0, initial_from[1])
    if cu_seqlens is None:  # one token per request: a batch of N sequences of length 1
        packed = (q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None])
    else:  # the requests packed along T
        packed = (q[None], k[None], v[None], g[None], beta[None])
    o, final = recurrent_gated_delta_rule_ref(
        *packed, initial, True, scale=scale, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens
    )
    assert final is not None
    state_pool.index_copy_(0, slots, final.to(state_pool.dtype))
    return o[:, 0] if cu_seqlens is None else o[0]


def gdn_gates_torch(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(g, beta)` from the raw projections `a, b: [N, Hv]`: `g = -exp(A_log) * softplus(a +
    dt_bias)` in float32 and `beta = sigmoid(b)` in b's dtype (HF's rounding)."""
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


Gates = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# (saved states [R, Hv, K, V], [N] int64 rows of them): where a row's state starts instead.
InitialStates = tuple[torch.Tensor, torch.Tensor]


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
    backend: str,
    gates: Gates | None,
    cu_seqlens: tuple[int, ...] | torch.Tensor | None,
    token_index: torch.Tensor | None = None,
    initial_from: InitialStates | None = None,
) -> torch.Tensor:
    """`gated_delta_rule_decode_` (cu_seqlens None), `gated_delta_rule_rows_` and
    `gated_delta_rule_replay_` (token_index / initial_from; its cu_seqlens may be a device
    vector)."""
    raw = gates is not None
    if raw != (g is None and beta is None):
        raise ValueError("pass either g and beta or gates=(a, b, A_log, dt_bias)")
    if gates is not None:
        g, beta, a_log, dt_bias = gates
        if a_log.shape != (v.shape[1],) or dt_bias.shape != (v.shape[1],):
            raise ValueError(f"A_log and dt_bias must be [{v.shape[1]}]")
    assert g is not None and beta is not None
    num_rows = None
    total = q.shape[0] if token_index is None else token_index.shape[0]
    cu_device = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else None
    if cu_device is not None:
        # A CUDA graph's replay reads its rows from static buffers: the values are the
        # caller's (`token_index` holds at least cu[-1] entries), only the shape is checked.
        if token_index is None or cu_device.dim() != 1 or cu_device.numel() < 2:
            raise ValueError("a device cu_seqlens needs token_index and at least one row")
        num_rows = cu_device.numel() - 1
        if not use_triton("gated_delta_rule_decode_", q.device, backend):
            # The reference loops over host offsets: read them (no graph on this path).
            cu_seqlens = tuple(int(c) for c in cu_device.tolist())
            token_index = token_index[: cu_seqlens[-1]]
            total = token_index.shape[0]
    elif cu_seqlens is not None:
        num_rows = len(cu_seqlens) - 1
        if num_rows < 0 or cu_seqlens[0] != 0 or cu_seqlens[-1] != total:
            raise ValueError(f"cu_seqlens must run from 0 to T={total}, got {cu_seqlens}")
        if any(b <= a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
            raise ValueError(f"cu_seqlens must be increasing (no empty row), got {cu_seqlens}")
    _check(q, k, v, g, beta, state_pool, slots, num_rows)
    if initial_from is not None and (
        initial_from[0].shape[1:] != state_pool.shape[1:] or initial_from[1].shape != slots.shape
    ):
        raise ValueError(
            f"initial states must be [R, {list(state_pool.shape[1:])}] with one row index per "
            f"slot, got {tuple(initial_from[0].shape)} and {tuple(initial_from[1].shape)}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not use_triton("gated_delta_rule_decode_", q.device, backend):
        if gates is not None:
            g, beta = gdn_gates_torch(*gates)
        if token_index is not None:
            q, k, v, g, beta = (t.index_select(0, token_index) for t in (q, k, v, g, beta))
        assert not isinstance(cu_seqlens, torch.Tensor)
        return _recurrent_torch(
            q, k, v, g, beta, state_pool, slots, scale, use_qk_l2norm, cu_seqlens, initial_from
        )
    n, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    out = v.new_empty(total, num_v_heads, head_v)
    if n == 0 or total == 0:
        return out
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if g.stride(-1) != 1 or beta.stride(-1) != 1:
        g, beta = g.contiguous(), beta.contiguous()
    a_log_arg, dt_bias_arg = (gates[2], gates[3]) if gates is not None else (g, g)
    # Shared by every layer of the step (one copy a step); decode passes slots as a stand-in.
    if cu_device is not None:
        cu = cu_device
    elif cu_seqlens is None:
        cu = slots
    else:
        cu = step_constant(cu_seqlens, torch.int64, q.device)
    rows = n if num_rows is None else num_rows
    block_v = _block_v(rows, num_v_heads, head_v)
    grid = (rows, num_v_heads, triton.cdiv(head_v, block_v))
    init, init_rows = initial_from if initial_from is not None else (state_pool, slots)
    if init.stride(-1) != 1:
        raise ValueError("initial states must be contiguous in their last dimension")
    _gdn_decode_kernel[grid](
        q, k, v, g, beta, out, state_pool, slots, cu,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        a_log_arg, dt_bias_arg, token_index if token_index is not None else slots,
        init, init_rows, init.stride(0), init.stride(1), init.stride(2),
        scale, _L2_EPS, int(token_index is not None), int(initial_from is not None),
        RATIO=num_v_heads // num_k_heads, K=head_k, V=head_v,
        BLOCK_K=triton.next_power_of_2(head_k), BLOCK_V=block_v, L2NORM=use_qk_l2norm,
        RAW_GATES=raw, ROWS=cu_seqlens is not None, num_warps=_NUM_WARPS or 4,
        **pdl_launch_kwargs(q.device, grid[0] * grid[1] * grid[2]),
    )  # fmt: skip
    return out


def gated_delta_rule_decode_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    backend: str = "auto",
    gates: Gates | None = None,
) -> torch.Tensor:
    """One token per request: `q, k: [N, Hk, K]`, `v: [N, Hv, V]`, `g, beta: [N, Hv]` (g is
    the log-decay) or, with g and beta None, `gates = (a, b, A_log, dt_bias)` (`[N, Hv]`,
    `[N, Hv]`, `[Hv]`, `[Hv]`) to form them in the kernel; request n's state is
    `state_pool[slots[n]]` (`[P, Hv, K, V]`, float32 or 16-bit), updated in place. Returns
    `o: [N, Hv, V]` in v's dtype."""
    return _run(q, k, v, g, beta, state_pool, slots, scale, use_qk_l2norm, backend, gates, None)


def gated_delta_rule_rows_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: tuple[int, ...],
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    backend: str = "auto",
    gates: Gates | None = None,
) -> torch.Tensor:
    """A few tokens per request, token by token as decode runs them (the verify and replay
    rows of a speculative step): as `gated_delta_rule_decode_` with the T tokens of the N
    requests packed along the first axis, request n's at `cu_seqlens[n]:cu_seqlens[n + 1]`
    (host offsets, none empty), from `state_pool[slots[n]]`. Each request is one program's
    loop over its tokens, so a row costs its length in sequential steps: for short rows
    (a chunked kernel pays off from tens of tokens). Returns `o: [T, Hv, V]`."""
    return _run(
        q, k, v, g, beta, state_pool, slots, scale, use_qk_l2norm, backend, gates, cu_seqlens
    )


def gated_delta_rule_replay_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: Gates | tuple[torch.Tensor, torch.Tensor],
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: tuple[int, ...] | torch.Tensor,
    token_index: torch.Tensor,
    initial_from: InitialStates,
    backend: str = "auto",
) -> None:
    """`gated_delta_rule_rows_` over rows of earlier inputs, from saved states: packed token t
    is row `token_index[t]` of q, k, v and the gates (`(a, b, A_log, dt_bias)`, or `(g,
    beta)`), and request n starts from `initial_from[0][initial_from[1][n]]` rather than its
    pool row, which gets the final state. An MTP rollback's replay of the accepted tokens in
    one launch a layer: no gathers of the recorded inputs, no restore of the pool rows.
    `cu_seqlens` may be an int64 device vector (a CUDA graph's static buffer, its values
    unchecked), with `token_index` as long as the most tokens it may hold."""
    rest = (state_pool, slots, None, True, backend)
    if len(gates) == 4:
        _run(q, k, v, None, None, *rest, gates, cu_seqlens, token_index, initial_from)
    else:
        g, beta = gates
        _run(q, k, v, g, beta, *rest, None, cu_seqlens, token_index, initial_from)
