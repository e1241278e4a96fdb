"""One Gated DeltaNet layer at a real model's sizes: the decode step and the conv1d prefill,
the torch path ("old") against the Triton kernels ("new").

    python benchmarks/bench_gdn.py --config benchmarks/configs/qwen3_6_27b.json

Decode: one layer step (in_proj GEMMs -> conv -> gates -> recurrence -> gated norm -> out_proj)
for each batch size, as the model serves it: a CUDA graph replay over the state pools
(`bench/gpu_timing.py`). "old" is the torch path as the model ran it before the fused kernels:
the conv rows gathered and scattered by the caller, torch conv / gates / norm chains, the
in-place Triton recurrence. "new" is the default: conv pool rows by slot, three kernels between
the GEMMs, in_proj_qkvz and in_proj_ba as one GEMM. The GEMMs alone are timed too (old: two
in_proj GEMMs, new: one), so `*_between_us` is what lies between them.
The decode recurrence kernel is also timed alone for each value-column tile (`_BLOCK_V`).
Prefill: the causal conv1d of one `--prefill-tokens` sequence over all conv channels (the torch
gather + float32 addcmul_ per tap vs the Triton varlen kernel), also as graph replays.
Verify: the layer over `batch` MTP verify rows of 1 + `--draft_len` tokens, eager wall time
(host work included): the in-place rows kernel against fla's chunked rule.
Random bf16 weights; the timings do not depend on the values. Finishes in well under a minute.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tensorrt_llm._torch.modules.causal_conv1d import causal_conv1d_fn
from tensorrt_llm._torch.modules.gated_delta_net import GatedDeltaNet, GatedDeltaNetMetadata
from tensorrt_llm._torch.modules.triton_kernels import gdn_decode
from tensorrt_llm._torch.modules.triton_kernels.causal_conv1d import causal_conv1d_varlen
from tensorrt_llm.bench.gpu_timing import graph_time_us


def random_layer(text: SimpleNamespace, device: torch.device, seed: int = 0) -> GatedDeltaNet:
    """The layer in bf16 with weights of realistic scale (HF's init: A ~ U(0, 16))."""
    torch.manual_seed(seed)
    layer = GatedDeltaNet.from_config(text, dtype=torch.bfloat16).to(device)
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


def _decode_us(layer: GatedDeltaNet, batch: int, fused: bool, iters: int) -> float:
    device = layer.dt_bias.device
    slots = torch.arange(1, batch + 1, device=device)  # row 0 is the dummy slot
    conv_pool = torch.randn(batch + 1, *layer.conv_state_shape, device=device).bfloat16()
    ssm_pool = torch.randn(batch + 1, *layer.ssm_state_shape, device=device) * 0.1
    x = torch.randn(batch, layer.hidden_size, device=device).bfloat16()
    meta = GatedDeltaNetMetadata(num_decodes=batch)
    layer.kernel_backend = "auto" if fused else "torch"
    layer.fuse_in_projections_()  # the engine's post-load step (joins only for "auto")

    def new() -> None:
        layer(x, conv_pool, ssm_pool, meta, ssm_slots=slots, conv_slots=slots)

    def old() -> None:  # the model's RecurrentStep.run before the conv pool went by slot
        conv = conv_pool.index_select(0, slots)
        layer(x, conv, ssm_pool, meta, ssm_slots=slots)
        conv_pool.index_copy_(0, slots, conv)

    with torch.no_grad():
        return graph_time_us(new if fused else old, iters)


def _gemm_us(layer: GatedDeltaNet, batch: int, fused: bool, iters: int) -> float:
    """The layer's GEMMs alone: in_proj_qkvz and in_proj_ba apart (old) or as one (new)."""
    x = torch.randn(batch, layer.hidden_size, device=layer.dt_bias.device).bfloat16()
    core = torch.randn(batch, layer.value_dim, device=x.device).bfloat16()
    w_in = torch.cat([layer.in_proj_qkvz.weight, layer.in_proj_ba.weight]).detach()

    def gemms() -> None:
        if fused:
            torch.nn.functional.linear(x, w_in)
        else:
            layer.in_proj_qkvz(x)
            layer.in_proj_ba(x)
        layer.out_proj(core)

    with torch.no_grad():
        return graph_time_us(gemms, iters)


def _recurrence_us(layer: GatedDeltaNet, batch: int, iters: int) -> dict[str, float]:
    """The decode recurrence kernel alone (gates formed in it), for each value-column tile and
    warp count (`_BLOCK_V`, `_NUM_WARPS`: the grid is batch x Hv x V / BLOCK_V programs), over
    a float32 pool (the default) and a bfloat16 one (`mamba_ssm_cache_dtype`)."""
    device = layer.dt_bias.device
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    q = torch.randn(batch, hk, dk, device=device).bfloat16()
    k = torch.randn(batch, hk, dk, device=device).bfloat16()
    v = torch.randn(batch, hv, dv, device=device).bfloat16()
    a = torch.randn(batch, hv, device=device).bfloat16()
    b = torch.randn(batch, hv, device=device).bfloat16()
    slots = torch.arange(1, batch + 1, device=device)
    gates = (a, b, layer.A_log.detach(), layer.dt_bias.detach())
    out: dict[str, float] = {}
    defaults = gdn_decode._BLOCK_V, gdn_decode._NUM_WARPS
    try:
        for dtype in (torch.float32, torch.bfloat16):
            pool = (torch.randn(batch + 1, hv, dk, dv, device=device) * 0.1).to(dtype)
            for block_v in (16, 32, 64, 128):
                for warps in (1, 2, 4, 8):
                    gdn_decode._BLOCK_V, gdn_decode._NUM_WARPS = block_v, warps
                    name = f"{str(dtype)[6:]} block_v={block_v} warps={warps}"
                    out[name] = round(
                        graph_time_us(
                            lambda pool=pool: gdn_decode.gated_delta_rule_decode_(
                                q, k, v, None, None, pool, slots, gates=gates
                            ),
                            iters,
                        ),
                        1,
                    )
    finally:
        gdn_decode._BLOCK_V, gdn_decode._NUM_WARPS = defaults
    return out


def _verify_us(layer: GatedDeltaNet, batch: int, k: int, iters: int) -> dict[str, float]:
    """One layer over `batch` MTP verify rows of 1 + k tokens each (every row continues its
    state), eager as the engine runs the mixer: wall time a call, host work included. "new":
    the in-place rows kernel (gated_delta_net_rows.py); "old": fla's chunked rule, the path the
    rows took before (RECURRENT_ROWS_MAX_TOKENS = 0)."""
    import time

    from tensorrt_llm._torch.modules import gated_delta_net_rows as rows_module

    device = layer.dt_bias.device
    slots = torch.arange(1, batch + 1, device=device)
    conv_pool = torch.randn(batch + 1, *layer.conv_state_shape, device=device).bfloat16()
    ssm_pool = torch.randn(batch + 1, *layer.ssm_state_shape, device=device) * 0.1
    x = torch.randn(batch * (1 + k), layer.hidden_size, device=device).bfloat16()
    meta = GatedDeltaNetMetadata((1 + k,) * batch, (True,) * batch)
    layer.kernel_backend = "auto"
    layer.fuse_in_projections_()

    def timed() -> float:
        for _ in range(3):
            layer(x, conv_pool, ssm_pool, meta, ssm_slots=slots, conv_slots=slots)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            layer(x, conv_pool, ssm_pool, meta, ssm_slots=slots, conv_slots=slots)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / iters * 1e6

    default = rows_module.RECURRENT_ROWS_MAX_TOKENS
    with torch.no_grad():
        new = timed()
        try:
            rows_module.RECURRENT_ROWS_MAX_TOKENS = 0
            old = timed()
        finally:
            rows_module.RECURRENT_ROWS_MAX_TOKENS = default
    return {"old_us": round(old, 1), "new_us": round(new, 1)}


# (BLOCK_T, BLOCK_C, num_warps) candidates of the varlen conv kernel; the first is the module's.
_CONV_TILES = ((32, 128, 4), (64, 128, 4), (16, 256, 4), (32, 256, 4), (64, 64, 4),
               (16, 512, 4), (32, 256, 8), (64, 256, 8), (8, 1024, 4), (128, 64, 4))  # fmt: skip


def _prefill_conv_us(layer: GatedDeltaNet, tokens: int, iters: int) -> dict[str, float]:
    """The conv of `tokens` prompt tokens: one sequence, and as the engine runs a prefill wave
    (sequences of 1024 from a strided slice of the joined in_proj output, with initial states
    read from and final states written to the pool by slot), per tile candidate."""
    device = layer.dt_bias.device
    weight, bias = layer.conv1d.weight[:, 0], layer.conv1d.bias
    x = torch.randn(tokens, layer.conv_dim, device=device).bfloat16()
    states = torch.zeros(1, *layer.conv_state_shape, device=device).bfloat16()
    old = graph_time_us(lambda: causal_conv1d_fn(x, weight, bias, (tokens,), states), iters)
    new = graph_time_us(
        lambda: causal_conv1d_varlen(x, weight, bias, (tokens,), None, None, states), iters
    )
    ref_states = states.clone()
    want = causal_conv1d_fn(x, weight, bias, (tokens,), ref_states)
    got = causal_conv1d_varlen(x, weight, bias, (tokens,), None, None, states)
    err = (got.float() - want.float()).abs().max().item()
    out: dict[str, float] = {"old_us": old, "new_us": new, "max_abs_diff": err}
    # The engine's layout: x a column slice of a wider row (z, b, a follow), pool rows by slot.
    lens = (1024,) * max(1, tokens // 1024)
    n = len(lens)
    wide = torch.randn(sum(lens), layer.conv_dim + layer.value_dim + 64, device=device)
    xs = wide.bfloat16()[:, : layer.conv_dim]
    pool = torch.randn(2 * n, *layer.conv_state_shape, device=device).bfloat16()
    init = pool[:n].clone()
    flags = torch.ones(n, dtype=torch.int32, device=device)
    rows = torch.arange(n, 2 * n, device=device)
    # "carried": every sequence continues from its state (chunked prefill); "fresh": none does.
    for kind, (i, f) in {"carried": (init, flags), "fresh": (None, None)}.items():
        base = None
        for tiles in _CONV_TILES:

            def run(t: tuple[int, int, int] = tiles, i: Any = i, f: Any = f) -> torch.Tensor:
                return causal_conv1d_varlen(xs, weight, bias, lens, i, f, pool, rows, tiles=t)

            got = run()
            base = got if base is None else base
            if not torch.equal(got, base):  # every tile computes the same fp32 sums in order
                raise AssertionError(f"conv tiles {tiles} differ from {_CONV_TILES[0]}")
            out[f"wave {kind} {'/'.join(map(str, tiles))} us"] = graph_time_us(run, iters)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="benchmarks/configs/qwen3_6_27b.json")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--draft_len", type=int, default=3, help="k of the verify rows (1 + k)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gdn.py needs a CUDA device")
    raw = json.loads(Path(args.config).read_text())
    text = SimpleNamespace(**raw.get("text_config", raw))
    layer = random_layer(text, torch.device("cuda"))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        gemm_old = _gemm_us(layer, batch, False, args.iters)
        gemm_new = _gemm_us(layer, batch, True, args.iters)
        old = _decode_us(layer, batch, False, args.iters)
        new = _decode_us(layer, batch, True, args.iters)
        rows.append(
            {"batch": batch, "old_us": round(old, 1), "new_us": round(new, 1),
             "old_gemms_us": round(gemm_old, 1), "new_gemms_us": round(gemm_new, 1),
             "old_between_us": round(old - gemm_old, 1),
             "new_between_us": round(new - gemm_new, 1)}
        )  # fmt: skip
        print(json.dumps({"decode_layer_step": rows[-1]}), flush=True)
        recurrence = _recurrence_us(layer, batch, args.iters)
        print(json.dumps({"decode_recurrence": {"batch": batch, **recurrence}}), flush=True)
        verify = _verify_us(layer, batch, args.draft_len, args.iters)
        print(json.dumps({"verify_rows": {"batch": batch, "k": args.draft_len, **verify}}))
    conv = _prefill_conv_us(layer, args.prefill_tokens, max(10, args.iters // 5))
    print(json.dumps({"prefill_conv1d": {"tokens": args.prefill_tokens, **conv}}), flush=True)


if __name__ == "__main__":
    main()
