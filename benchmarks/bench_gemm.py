"""Decode-size GEMMs of one Qwen3-VL-8B decoder layer: bf16 vs FP8 (quantise + `_scaled_mm`).

    python benchmarks/bench_gemm.py --rows 1 32 64 128

For each row count (= decode batch) it times the layer's four projections (qkv, o, gate_up,
down) in bf16 (`F.linear`), FP8 as served (`fp8_linear`: per-token quantisation kernel, then
up to `_TENSORWISE_MAX_ROWS` rows the unit-scale GEMM plus `scale_outer_`, else the row-wise
GEMM), the row-wise FP8 path forced, the row-wise GEMM alone, and the unit-scale (tensor-wise)
GEMM alone, and prints the per-step total over 36 layers and the weight bandwidth it reaches.
GPU only.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.modules import fp8_linear as fp8_module
from tensorrt_llm._torch.modules.fp8_linear import fp8_linear, quantize_fp8_rows
from tensorrt_llm._torch.modules.triton_kernels.fp8_quant import quantize_rows
from tensorrt_llm.bench.gpu_timing import graph_time_us

# (name, out_features, in_features) of one Qwen3-VL-8B text layer.
_SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288))
_LAYERS = 36


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 128, 256, 512, 1024])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm.py needs a GPU")
    weights = {}
    for name, n, k in _SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, scale = quantize_fp8_rows(w)
        weights[name] = (w, wq, scale.view(-1).contiguous())
    one = torch.ones((), device="cuda")
    bf16_bytes = sum(2 * n * k for _, n, k in _SHAPES) * _LAYERS
    for rows in args.rows:
        totals = dict.fromkeys(
            ("bf16", "fp8", "fp8 row-wise", "row-wise gemm only", "tensor-wise gemm only"), 0.0
        )
        for name, _, k in _SHAPES:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w, wq, ws = weights[name]
            xq, xs = quantize_rows(x, rows_out=rows + (-rows) % 16)
            served = graph_time_us(partial(fp8_linear, x, wq, ws, None))
            limit, fp8_module._TENSORWISE_MAX_ROWS = fp8_module._TENSORWISE_MAX_ROWS, 0
            try:
                rowwise = graph_time_us(partial(fp8_linear, x, wq, ws, None))
            finally:
                fp8_module._TENSORWISE_MAX_ROWS = limit
            t = {
                "bf16": graph_time_us(partial(F.linear, x, w)),
                "fp8": served,
                "fp8 row-wise": rowwise,
                "row-wise gemm only": graph_time_us(
                    partial(
                        torch._scaled_mm,
                        xq,
                        wq.t(),
                        scale_a=xs,
                        scale_b=ws.view(1, -1),
                        out_dtype=torch.bfloat16,
                        use_fast_accum=True,
                    )
                ),
                # Scalar scales take cuBLASLt's tensor-wise FP8 kernels instead of the
                # row-wise ones (about twice the bandwidth at decode row counts).
                "tensor-wise gemm only": graph_time_us(
                    partial(
                        torch._scaled_mm,
                        xq,
                        wq.t(),
                        scale_a=one,
                        scale_b=one,
                        out_dtype=torch.bfloat16,
                        use_fast_accum=True,
                    )
                ),
            }
            print(
                f"rows {rows:4d} {name:8s} " + "  ".join(f"{m} {v:7.1f} us" for m, v in t.items())
            )
            for m, v in t.items():
                totals[m] += v * _LAYERS
        summary = []
        for m, v in totals.items():
            weight_bytes = bf16_bytes if m == "bf16" else bf16_bytes / 2
            summary.append(f"{m} {v / 1e3:.2f} ms ({weight_bytes / v / 1e6:.2f} TB/s)")
        print(f"rows {rows:4d} per step (36 layers): " + ", ".join(summary), flush=True)


if __name__ == "__main__":
    main()
