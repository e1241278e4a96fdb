"""Sweep the decode-size FP8 GEMM kernel's tiles and split counts on Qwen3-VL-8B layer shapes.

    python benchmarks/tune_fp8_gemm.py --rows 1 32 128

For each row count, operand form (W8A8: e4m3 activations with row scales; W8A16: bf16
activations) and layer shape it times every candidate as a replayed CUDA graph and prints
the best few, the default (`default_tiles` + `choose_splits`, marked `*`) and the per-step
total over 36 layers next to bf16 `F.linear` (W8A8 totals include the activation
quantisation kernel). GPU only.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.modules.fp8_linear import quantize_fp8_rows
from tensorrt_llm._torch.modules.triton_kernels.fp8_gemm import GemmTiles, default_tiles, fp8_gemm
from tensorrt_llm._torch.modules.triton_kernels.fp8_quant import quantize_rows

_SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288))
_LAYERS = 36


def _time_us(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--block_n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--block_k", type=int, nargs="+", default=[128, 256])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 5])
    p.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="0 = default")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_fp8_gemm.py needs a GPU")
    weights = {}
    for name, n, k in _SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, scale = quantize_fp8_rows(w)
        weights[name] = (w, wq, scale.view(-1).contiguous())
    for rows in args.rows:
        best_total = {"w8a8": 0.0, "w8a16": 0.0, "bf16": 0.0}
        default_total = {"w8a8": 0.0, "w8a16": 0.0}
        for name, _, k in _SHAPES:
            w, wq, ws = weights[name]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_fp8_rows(x)
            bf16 = _time_us(partial(F.linear, x, w))
            quant = _time_us(partial(quantize_rows, x))  # W8A8 pays this per layer call
            best_total["bf16"] += bf16 * _LAYERS
            for form, a, a_scale in (("w8a8", xq, xs), ("w8a16", x, None)):
                default = default_tiles(rows, k, form == "w8a8", True)
                results = []
                for block_n, block_k, stages, splits in itertools.product(
                    args.block_n, args.block_k, args.stages, args.splits
                ):
                    tiles = GemmTiles(default.block_m, block_n, block_k, stages, 4)
                    try:
                        us = _time_us(
                            partial(
                                fp8_gemm, a, wq, ws, a_scale, tiles=tiles, num_splits=splits or None
                            )
                        )
                    except Exception as exc:  # shared memory and the like
                        print(f"  skip {tiles} splits={splits}: {type(exc).__name__}", flush=True)
                        continue
                    results.append((us, block_n, block_k, stages, splits))
                results.sort()
                d_us = _time_us(partial(fp8_gemm, a, wq, ws, a_scale))
                extra = quant if form == "w8a8" else 0.0
                best_total[form] += (results[0][0] + extra) * _LAYERS
                default_total[form] += (d_us + extra) * _LAYERS
                top = "; ".join(
                    f"BN{bn} BK{bk} st{st} sp{sp or 'auto'} {us:.1f}"
                    for us, bn, bk, st, sp in results[:4]
                )
                print(
                    f"rows {rows:3d} {name:7s} {form:5s} bf16 {bf16:6.1f} us | default* "
                    f"{d_us:6.1f} us | best: {top}",
                    flush=True,
                )
        print(
            f"rows {rows:3d} per step (36 layers, ms): bf16 {best_total['bf16'] / 1e3:.2f}, "
            + ", ".join(
                f"{f} best {best_total[f] / 1e3:.2f} default {default_total[f] / 1e3:.2f}"
                for f in ("w8a8", "w8a16")
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
