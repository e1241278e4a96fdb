"""Qwen3.6-35B-A3B MoE layer pieces at decode sizes, CUDA-graph timed (GPU only, < 90 s).

    python benchmarks/bench_moe.py --output moe.json

At H 2048, 256 routed experts + the fused shared expert (I 512), top-8, bf16, for M tokens
(default 1, 4, 16, 64), the mean GPU time of a graph replay (`bench/gpu_timing.py`) of:
- routing: the old torch path (softmax/top-k + `moe_align_block_size`, with the shared
  expert's gate GEMV and sigmoid apart) against `moe_route` (one kernel + one alignment);
- the old separate shared expert (gate, sigmoid, GatedMLP, scale and add);
- the grouped GEMMs over the candidate tiles: `gate_up_silu` alone and `down_weighted` with its
  k-sum ("sum") or atomics ("atomic"), each on the layout of its BLOCK_M;
- the GEMV kernels (`moe_gemv.py`) over their tiles;
- the layer as served before (torch routing + grouped GEMM + separate shared expert) and now
  (`MoE.forward` with the fused shared expert and today's `moe_tiles.TILE_TABLE`);
- the fused router GEMM alone at `--router_tokens` rows: its E + 1 = 257 output columns
  against a weight padded to 264 rows (16-byte rows: in the c=128 prefill profile at f7b8d2a
  the 257-column GEMM ran as a `cutlass_75` kernel, 157 us a call).
- with `--fp8_block_tokens` (alias `--prefill_fp8_tokens`), the grouped GEMMs of block-FP8
  experts (shared expert fused, as a -FP8 release loads) at those token counts over the
  candidates (`_DECODE_*` up to 512 tokens, `_PREFILL_*` above) and the table's tiles, each checked
  against the table's tiles' output: the table's last bucket has never been measured.
Read it as: per M, copy the fastest gate_up and down tiles into `moe_tiles.TILE_TABLE` (and
set `GEMV_MAX_TOKENS` to the largest power-of-two M where GEMV wins).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.modules.fused_moe import MoE
from tensorrt_llm._torch.modules.triton_kernels import fused_moe as fm
from tensorrt_llm._torch.modules.triton_kernels.moe_gemv import fused_moe_gemv
from tensorrt_llm._torch.modules.triton_kernels.moe_routing import (
    moe_align,
    moe_route,
    route_ref,
)
from tensorrt_llm._torch.modules.triton_kernels.moe_tiles import GemvTiles, MoETiles, pick_tiles
from tensorrt_llm.bench.gpu_timing import graph_time_us

H, E, TOP_K, INTER = 2048, 256, 8, 512
DEVICE = "cuda"  # a CPU dry run (TRITON_INTERPRET=1, tiny sizes) patches these
_TOKENS = (1, 4, 16, 64)
# (BLOCK_N, BLOCK_K, num_warps, num_stages)
_GATE_UP = ((16, 128, 4, 4), (32, 64, 4, 3), (32, 128, 4, 4), (64, 64, 4, 3), (64, 128, 4, 4))
_DOWN = ((32, 128, 4, 4), (64, 64, 4, 3), (64, 128, 4, 4), (128, 64, 8, 3))
_GEMV = (GemvTiles(16, 32, 256, 4), GemvTiles(32, 64, 256, 4), GemvTiles(16, 32, 512, 4),
         GemvTiles(16, 16, 512, 4, down_per_pair=False),
         GemvTiles(16, 32, 256, 4, down_per_pair=False))  # fmt: skip


def _moe() -> MoE:
    torch.manual_seed(0)
    moe = MoE(E, TOP_K, H, INTER, shared_expert_intermediate_size=INTER, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    return moe.to(DEVICE).eval()


def _old_routing(x: torch.Tensor, moe: MoE, block_m: int) -> None:
    logits = F.linear(x, moe.gate.weight)
    weights, ids = route_ref(logits, TOP_K)
    fm.moe_align_block_size(ids, E, block_m)
    assert moe.shared_expert_gate is not None
    torch.sigmoid(moe.shared_expert_gate(x))


def _new_routing(x: torch.Tensor, moe: MoE, block_m: int):
    logits = moe.gate.logits(x)  # [T, E + 1]: the shared expert's gate included
    return moe_route(logits, TOP_K, True, True, block_m, "triton")


def _old_shared(x: torch.Tensor, moe: MoE, routed: torch.Tensor) -> torch.Tensor:
    assert moe.shared_expert is not None and moe.shared_expert_gate is not None
    return routed + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)


def _old_layer(x: torch.Tensor, moe: MoE) -> torch.Tensor:
    logits = F.linear(x, moe.gate.weight)
    weights, ids = route_ref(logits, TOP_K)
    e = moe.experts
    # As served before: the torch alignment and 64 x 64 tiles at every M.
    layout = fm.moe_align_block_size(ids, E, 16)
    routed = fm.fused_moe(x, e.gate_up_proj, e.down_proj, ids, weights, layout=layout,
                          tiles=MoETiles(16, 64, 64, 64, 64))  # fmt: skip
    return _old_shared(x, moe, routed)


def _tiles(block_m: int, gate_up: tuple[int, ...], down: tuple[int, ...], combine: str):
    return (
        MoETiles(block_m, gate_up[0], gate_up[1], 64, 64, gate_up[2], gate_up[3]),
        MoETiles(block_m, 64, 64, down[0], down[1], down[2], down[3], combine),
    )


def _fmt(cfg: object) -> str:
    return "/".join(str(v) for v in cfg) if isinstance(cfg, tuple) else str(cfg)


def bench(tokens: tuple[int, ...]) -> list[dict[str, object]]:
    moe = _moe()
    w1s, w2s = moe.experts.gate_up_proj, moe.experts.down_proj
    gen = torch.Generator(DEVICE).manual_seed(1)
    rows: list[dict[str, object]] = []
    inputs = {m: torch.randn(m, H, device=DEVICE, dtype=torch.bfloat16, generator=gen)
              for m in tokens}  # fmt: skip
    old_layer = {m: graph_time_us(partial(_old_layer, x, moe)) for m, x in inputs.items()}
    old_route = {m: graph_time_us(partial(_old_routing, x, moe, 16)) for m, x in inputs.items()}
    old_shared = {m: graph_time_us(partial(_old_shared, x, moe, x)) for m, x in inputs.items()}
    assert moe.fuse_shared_expert_()
    w1, w2 = moe.experts.gate_up_proj, moe.experts.down_proj
    k = TOP_K + 1
    del w1s, w2s
    for m, x in inputs.items():
        t0 = time.time()
        block_m = pick_tiles(m, k, E + 1).block_m
        weights, ids, layout = _new_routing(x, moe, block_m)
        assert layout is not None
        row: dict[str, object] = {"tokens": m, "block_m": block_m, "us": {}}
        us: dict[str, float] = row["us"]  # type: ignore[assignment]
        us["old layer"] = old_layer[m]
        us["new layer"] = graph_time_us(partial(moe, x))
        us["old routing+align"] = old_route[m]
        us["new routing+align"] = graph_time_us(partial(_new_routing, x, moe, block_m))
        us["new align alone"] = graph_time_us(partial(moe_align, ids, E + 1, block_m))
        us["old shared expert"] = old_shared[m]
        act = fm.gate_up_silu(x, w1, layout, k, _tiles(block_m, _GATE_UP[0], _DOWN[0], "sum")[0])
        for cfg in _GATE_UP:
            tiles = _tiles(block_m, cfg, _DOWN[0], "sum")[0]
            us[f"gate_up {_fmt(cfg)}"] = graph_time_us(
                partial(fm.gate_up_silu, x, w1, layout, k, tiles)
            )
        for cfg in _DOWN:
            for combine in ("sum", "atomic"):
                tiles = _tiles(block_m, _GATE_UP[0], cfg, combine)[1]
                us[f"down {_fmt(cfg)} {combine}"] = graph_time_us(
                    partial(fm.down_weighted, act, w2, layout, weights, tiles)
                )
        for g in _GEMV:
            per = "pair" if g.down_per_pair else "token"
            name = f"gemv {g.gate_up_n}/{g.down_n}/{g.block_k}/{g.num_warps} {per}"
            us[name] = graph_time_us(partial(fused_moe_gemv, x, w1, w2, ids, weights, g))
        best_gu = min((v, n) for n, v in us.items() if n.startswith("gate_up"))
        best_dn = min((v, n) for n, v in us.items() if n.startswith("down"))
        best_gemv = min((v, n) for n, v in us.items() if n.startswith("gemv"))
        row["best"] = {"gate_up": best_gu[1], "down": best_dn[1], "gemv": best_gemv[1]}
        print(f"\n=== M {m} (pairs {m * k}, BLOCK_M {block_m}, {time.time() - t0:.1f} s)")
        for name, v in us.items():
            print(f"  {name:36s} {v:8.1f} us")
        print(f"  best grouped: {best_gu[1]} + {best_dn[1]} = {best_gu[0] + best_dn[0]:.1f} us;"
              f" best {best_gemv[1]} = {best_gemv[0]:.1f} us", flush=True)  # fmt: skip
        rows.append(row)
    return rows


def router_gemm(tokens: tuple[int, ...]) -> list[dict[str, float]]:
    """The [T, H] x [H, E + 1] router GEMM, as fused (257 columns) and padded to 264."""
    gen = torch.Generator(DEVICE).manual_seed(2)
    weight = torch.randn(E + 1, H, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    padded = torch.cat([weight, weight.new_zeros(-(E + 1) % 8, H)])
    rows = []
    for m in tokens:
        x = torch.randn(m, H, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        row = {
            "tokens": m,
            "257 columns us": graph_time_us(partial(F.linear, x, weight)),
            "264 columns us": graph_time_us(partial(F.linear, x, padded)),
        }
        print(json.dumps({"router_gemm": row}), flush=True)
        rows.append(row)
    return rows


# Candidates for block-FP8 experts (the K tile is the 128-wide scale block there):
# (BLOCK_M, BLOCK_N, num_warps, num_stages). Steps of more than 512 tokens take the prefill
# lists; smaller ones (decode batches: at 128 tokens nearly every expert is read once, so
# the GEMMs are weight-read bound) the decode lists. The table's own tiles are always timed.
_PREFILL_GATE_UP = ((64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3),
                    (128, 64, 8, 3), (128, 128, 8, 3))  # fmt: skip
_PREFILL_DOWN = ((64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 4), (64, 256, 8, 3),
                 (128, 64, 8, 3), (128, 128, 8, 3))  # fmt: skip
_DECODE_GATE_UP = ((16, 32, 4, 4), (16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3),
                   (16, 128, 8, 3), (32, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3),
                   (64, 128, 4, 3), (64, 128, 8, 3))  # fmt: skip
_DECODE_DOWN = ((16, 32, 4, 4), (16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3),
                (16, 128, 8, 3), (16, 256, 8, 3), (32, 64, 4, 3), (32, 128, 4, 3),
                (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3),
                (64, 256, 8, 3))  # fmt: skip
_DECODE_MAX_TOKENS = 512


def _block_tiles(cfg: tuple[int, int, int, int], combine: str = "sum") -> MoETiles:
    block_m, n, warps, stages = cfg
    return MoETiles(block_m, n, 128, n, 128, warps, stages, combine)


def _table_cfgs(m: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """The table's (gate_up, down) tiles for a block-FP8 step of m tokens, as candidates."""
    t = pick_tiles(m, TOP_K + 1, E + 1, block_scaled=True)
    down_warps = t.down_num_warps or t.num_warps
    return (t.block_m, t.gate_up_n, t.num_warps, t.num_stages), (
        t.block_m, t.down_n, down_warps, t.num_stages)  # fmt: skip


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # bf16 outputs; the fp32 sums differ only in their order between tiles
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{what}: {m}")


def block_fp8(tokens: tuple[int, ...]) -> list[dict[str, object]]:
    """The grouped GEMMs of block-FP8 experts (the -FP8 release's layout, shared expert fused)
    at each token count over the candidates (`_PREFILL_*` / `_DECODE_*`) and the table's
    tiles: each kernel alone, on the layout of its BLOCK_M; the down figure includes its k-sum
    ("sum") or atomics."""
    moe = _moe()
    assert moe.fuse_shared_expert_()
    experts = moe.experts
    experts.quantize_fp8_block_()
    scales = experts.block_scales()
    assert scales is not None
    w1, w2, k = experts.gate_up_proj, experts.down_proj, TOP_K + 1
    gen = torch.Generator(DEVICE).manual_seed(3)
    rows: list[dict[str, object]] = []
    for m in tokens:
        t0 = time.time()
        x = torch.randn(m, H, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        weights, ids, _ = moe.gate.route(x)
        table_gu, table_dn = _table_cfgs(m)
        decode = m <= _DECODE_MAX_TOKENS
        gate_ups = list(
            dict.fromkeys([table_gu, *(_DECODE_GATE_UP if decode else _PREFILL_GATE_UP)])
        )
        downs = list(dict.fromkeys([table_dn, *(_DECODE_DOWN if decode else _PREFILL_DOWN)]))
        us: dict[str, float] = {}
        best: dict[int, float] = {}
        out: torch.Tensor | None = None  # the first layout's output: every tile must give it
        for block_m in sorted({cfg[0] for cfg in gate_ups + downs}):
            layout = fm.moe_align_block_size(ids, E + 1, block_m)
            gate_up = [c for c in gate_ups if c[0] == block_m] or [(block_m, 64, 4, 3)]
            down = [c for c in downs if c[0] == block_m] or [(block_m, 64, 4, 3)]
            act_m = fm.gate_up_silu(x, w1, layout, k, _block_tiles(gate_up[0]), scales)
            if out is None:
                out = fm.down_weighted(act_m, w2, layout, weights, _block_tiles(down[0]), scales)
            for cfg in gate_up:
                fn = partial(fm.gate_up_silu, x, w1, layout, k, _block_tiles(cfg), scales)
                _same(fn(), act_m, f"gate_up {cfg}")
                us[f"gate_up {_fmt(cfg)}"] = graph_time_us(fn)
            for cfg in down:
                for combine in ("sum", "atomic"):
                    tiles = _block_tiles(cfg, combine)
                    fn = partial(fm.down_weighted, act_m, w2, layout, weights, tiles, scales)
                    _same(fn(), out, f"down {cfg} {combine}")  # a wrong tile is no choice
                    us[f"down {_fmt(cfg)} {combine}"] = graph_time_us(fn)
            gu = min(v for n, v in us.items() if n.startswith(f"gate_up {block_m}/"))
            dn = min(v for n, v in us.items() if n.startswith(f"down {block_m}/"))
            best[block_m] = gu + dn
        table = us["gate_up " + _fmt(table_gu)] + us["down " + _fmt(table_dn) + " sum"]
        row = {"tokens": m, "us": us, "table us": table, "best us by BLOCK_M": best,
               "table tiles": [table_gu, table_dn]}  # fmt: skip
        print(f"\n=== fp8_block M {m} (pairs {m * k}, {time.time() - t0:.1f} s)")
        for name, v in sorted(us.items(), key=lambda item: item[1]):
            print(f"  {name:36s} {v:8.1f} us")
        print(f"  table's tiles {_fmt(table_gu)} + {_fmt(table_dn)}: {table:.1f} us; best "
              "gate_up + down by BLOCK_M: "
              + ", ".join(f"{bm}: {v:.1f} us" for bm, v in best.items()), flush=True)  # fmt: skip
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="*", default=list(_TOKENS))
    p.add_argument("--router_tokens", type=int, nargs="*", default=[1, 16, 128, 1024, 8192])
    p.add_argument(
        "--prefill_fp8_tokens", "--fp8_block_tokens", type=int, nargs="*", default=[],
        help="also sweep the block-FP8 grouped GEMM tiles at these token counts",
    )  # fmt: skip
    p.add_argument("--output", help="write the figures as JSON here")
    args = p.parse_args()
    start = time.time()
    rows = bench(tuple(args.tokens)) if args.tokens else []
    router = router_gemm(tuple(args.router_tokens))
    prefill = block_fp8(tuple(args.prefill_fp8_tokens))
    print(f"\ntotal {time.time() - start:.1f} s")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            out = {"device": torch.cuda.get_device_name(), "rows": rows, "router_gemm": router,
                   "prefill_fp8": prefill}  # fmt: skip
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
