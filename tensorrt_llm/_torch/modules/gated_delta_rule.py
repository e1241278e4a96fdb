"""The gated delta rule (Gated DeltaNet's recurrence): torch references and an fla dispatcher.

Per value head, with a state `S: [k_dim, v_dim]`, each token t does

    S   <- exp(g_t) * S                               (gated decay, g_t <= 0)
    u_t  = beta_t * (v_t - S^T k_t)                   (delta rule: write only the error)
    S   <- S + k_t u_t^T
    o_t  = S^T (scale * q_t)

Tensor layout follows fla (batch-first, token-major):
    q, k: [B, T, num_k_heads, k_dim]    v: [B, T, num_v_heads, v_dim]
    g, beta: [B, T, num_v_heads]        state: [N, num_v_heads, k_dim, v_dim]
`num_v_heads` may be a multiple of `num_k_heads` (grouped value heads): q/k head h serves
value heads `h * r ... h * r + r - 1` (repeat_interleave), as HF's Qwen3.5 / Qwen3-Next do.
With `cu_seqlens` (host offsets, B must be 1) the T axis packs N sequences and each gets its
own initial and final state.

The references compute in float32 and return the output in q's dtype and the final state in
float32. `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` use fla's Triton kernels
when fla imports and the tensors are on CUDA, else the references.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..._utils import step_constant

_Result = tuple[torch.Tensor, torch.Tensor | None]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim (fla's and HF's definition)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: Sequence[int] | None,
) -> int:
    """Check shapes; return the number of sequences (N)."""
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must be [B, T, H, K] and equal, got {q.shape} and {k.shape}")
    batch, length, num_k_heads, _ = q.shape
    if v.dim() != 4 or v.shape[:2] != (batch, length):
        raise ValueError(f"v must be [B, T, Hv, V] matching q {q.shape}, got {v.shape}")
    num_v_heads = v.shape[2]
    if num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"num_v_heads={num_v_heads} is not a multiple of num_k_heads={num_k_heads}"
        )
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != v.shape[:3]:
            raise ValueError(
                f"{name} must be [B, T, Hv] = {tuple(v.shape[:3])}, got {tuple(t.shape)}"
            )
    num_seqs = batch
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs batch size 1 (packed tokens), got B={batch}")
        if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != length:
            raise ValueError(f"cu_seqlens must run from 0 to T={length}, got {list(cu_seqlens)}")
        if any(b < a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {list(cu_seqlens)}")
        num_seqs = len(cu_seqlens) - 1
    want = (num_seqs, num_v_heads, q.shape[-1], v.shape[-1])
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(f"initial_state must be {want}, got {tuple(initial_state.shape)}")
    return num_seqs


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """float32, heads before time ([B, H, T, D]); q/k normalised, expanded to Hv and q scaled."""
    ratio = v.shape[2] // q.shape[2]
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if ratio > 1:
        q = q.repeat_interleave(ratio, dim=1)
        k = k.repeat_interleave(ratio, dim=1)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    return q, k, v, g, beta


def _run_segments(
    step: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: Sequence[int] | None,
    scale: float | None,
    use_qk_l2norm: bool,
) -> _Result:
    """Apply `step(q, k, v, g, beta, state)` (float32, [B, H, L, D]) to the whole batch, or to
    each packed sequence of `cu_seqlens` in turn."""
    num_seqs = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = q.dtype
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    state_shape = (num_seqs, vf.shape[1], qf.shape[-1], vf.shape[-1])
    if initial_state is None:
        states = vf.new_zeros(state_shape)
    else:
        states = initial_state.float()
    if cu_seqlens is None:
        out, final = step(qf, kf, vf, gf, bf, states)
    else:
        outs, finals = [], []
        for n in range(num_seqs):
            span = slice(cu_seqlens[n], cu_seqlens[n + 1])
            o, s = step(
                qf[:, :, span],
                kf[:, :, span],
                vf[:, :, span],
                gf[:, :, span],
                bf[:, :, span],
                states[n : n + 1],
            )
            outs.append(o)
            finals.append(s)
        out, final = torch.cat(outs, dim=2), torch.cat(finals)
    return out.transpose(1, 2).to(out_dtype), (final if output_final_state else None)


def _recurrent_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q/k: [B, H, L, K]; v: [B, H, L, V]; g/beta: [B, H, L]; state [B, H, K, V]."""
    outs = []
    for t in range(q.shape[2]):
        state = state * g[..., t].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        update = (v[:, :, t] - predicted) * beta[..., t, None]
        state = state + k[:, :, t, :, None] * update[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    if not outs:
        return torch.zeros_like(v), state
    return torch.stack(outs, dim=2), state


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Sequence[int] | None = None,
) -> _Result:
    """Token-by-token gated delta rule (decode: T = 1). Returns (o [B,T,Hv,V], state or None)."""
    return _run_segments(
        _recurrent_steps,
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        output_final_state,
        cu_seqlens,
        scale,
        use_qk_l2norm,
    )


def _chunk_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk by chunk (WY form). Shapes as `_recurrent_steps`.

    Inside a chunk with cumulative log-decay c_i and start state S0, the written values solve
    the unit lower-triangular system (I + A) U = beta*V - beta*exp(c)*K S0 with
    A_ij = beta_i exp(c_i - c_j) k_i.k_j for j < i, so a chunk costs a few matmuls and one
    triangular solve instead of `chunk_size` sequential steps.
    """
    batch, heads, length, _ = q.shape
    pad = (-length) % chunk_size
    if pad:
        # Zero k/v/beta/g rows are inert: they write nothing and do not decay the state.
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (length + pad) // chunk_size
    q, k, v = (x.reshape(batch, heads, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, n, chunk_size) for x in (g, beta))
    cum = g.cumsum(dim=-1)  # [B, H, N, C]
    # exp(c_i - c_j) for j <= i; the upper triangle is masked before exp so it cannot overflow.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    rel = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    lower = (k @ k.transpose(-1, -2)) * rel.tril(-1) * beta[..., :, None]
    system = lower + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    w_v = torch.linalg.solve_triangular(
        system, v * beta[..., None], upper=False, unitriangular=True
    )
    w_k = torch.linalg.solve_triangular(
        system, k * (beta * cum.exp())[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * rel  # includes the diagonal: o_i reads its own write
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    outs = []
    for i in range(n):
        u = w_v[:, :, i] - w_k[:, :, i] @ state  # the values this chunk writes, [B, H, C, V]
        outs.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    if not outs:
        return v.reshape(batch, heads, 0, v.shape[-1]), state
    return torch.cat(outs, dim=2)[:, :, :length], state


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Sequence[int] | None = None,
) -> _Result:
    """Chunked gated delta rule (prefill). Same arguments and results as the recurrent form."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")

    def step(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _chunk_steps(*args, chunk_size=chunk_size)

    return _run_segments(
        step, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, scale, use_qk_l2norm
    )


@lru_cache(maxsize=1)
def _fla_ops() -> tuple[Callable[..., _Result], Callable[..., _Result]] | None:
    """fla's (chunk, fused_recurrent) kernels, or None when fla is not installed."""
    try:
        from fla.ops.gated_delta_rule import (  # type: ignore[import-not-found]
            chunk_gated_delta_rule as fla_chunk,
        )
        from fla.ops.gated_delta_rule import (  # type: ignore[import-not-found]
            fused_recurrent_gated_delta_rule as fla_recurrent,
        )
    except Exception:  # noqa: BLE001 - any import failure (missing, broken triton) means "no fla"
        return None
    return fla_chunk, fla_recurrent


def fla_available() -> bool:
    return _fla_ops() is not None


# fla runs grouped value heads natively (q/k head `i // (Hv / Hk)` for value head i, the
# repeat_interleave layout) from its GVA support (fla-org/flash-linear-attention#421, June
# 2025); 0.4.0 is the first release we are sure carries it in both kernels. Older ones get
# q and k expanded here, which costs a copy of each at Hv heads per layer and prefill step.
FLA_NATIVE_GVA_VERSION = (0, 4)


def fla_native_gva(version: str | None = None) -> bool:
    """Whether the installed fla (or `version`) takes num_v_heads > num_k_heads as is."""
    if version is None:
        version = _fla_version()
    numbers = []
    for part in version.split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            return False
        numbers.append(int(digits))
    return tuple(numbers) >= FLA_NATIVE_GVA_VERSION


@lru_cache(maxsize=1)
def _fla_version() -> str:
    try:
        import fla  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - as _fla_ops: no usable fla
        return "0"
    return str(getattr(fla, "__version__", "0"))


def _call_fla(
    op: Callable[..., _Result],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    *,
    scale: float | None,
    use_qk_l2norm: bool,
    cu_seqlens: Sequence[int] | None,
    pass_host_offsets: bool = False,
    expand_heads: bool = True,
) -> _Result:
    _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    ratio = v.shape[2] // q.shape[2]
    if ratio > 1 and expand_heads:  # an fla without grouped value heads (`fla_native_gva`)
        q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    offsets, extra = None, {}
    if cu_seqlens is not None:
        # Shared objects across the layers of a step: fla's per-tensor cache then builds its
        # chunk index table once per step instead of once per layer (each build is a readback).
        key = tuple(int(x) for x in cu_seqlens)
        offsets = step_constant(key, torch.long, q.device)
        host = step_constant(key, torch.long, torch.device("cpu"))
        if pass_host_offsets:  # the chunk kernel then plans its chunks without a readback
            extra["cu_seqlens_cpu"] = host
    state = initial_state.float().contiguous() if initial_state is not None else None
    # Everything after q, k, v goes by keyword: fla's fused recurrent kernel takes optional
    # per-key/per-value gates (gk, gv) between g and beta, so a positional beta lands on gk.
    return op(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g=g.float().contiguous(),
        beta=beta.contiguous(),
        scale=scale,
        initial_state=state,
        output_final_state=output_final_state,
        cu_seqlens=offsets,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        **extra,
    )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Sequence[int] | None = None,
) -> _Result:
    """Prefill: fla's chunk kernel on CUDA when installed, else `chunk_gated_delta_rule_ref`."""
    opts = {"scale": scale, "use_qk_l2norm": use_qk_l2norm, "cu_seqlens": cu_seqlens}
    ops = _fla_ops() if q.is_cuda else None
    if ops is not None:
        return _call_fla(
            ops[0], q, k, v, g, beta, initial_state, output_final_state, **opts,
            pass_host_offsets=True, expand_heads=not fla_native_gva(),
        )  # fmt: skip
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state, output_final_state, **opts)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Sequence[int] | None = None,
) -> _Result:
    """Decode: fla's fused recurrent kernel on CUDA when installed, else the recurrent reference.

    NOTE: without cu_seqlens neither path syncs with the host, so decode can be graph-captured.
    """
    opts = {"scale": scale, "use_qk_l2norm": use_qk_l2norm, "cu_seqlens": cu_seqlens}
    ops = _fla_ops() if q.is_cuda else None
    if ops is not None:
        return _call_fla(
            ops[1], q, k, v, g, beta, initial_state, output_final_state, **opts,
            expand_heads=not fla_native_gva(),
        )  # fmt: skip
    return recurrent_gated_delta_rule_ref(
        q, k, v, g, beta, initial_state, output_final_state, **opts
    )
