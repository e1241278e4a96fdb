"""Block-FP8 GEMMs and MoE experts at decode and prefill sizes, CUDA-graph timed (GPU only).

    python benchmarks/bench_fp8_block.py --output fp8_block.json

Per shape (Qwen3-VL-8B's qkv, o, gate_up, down) and row count M: the block GEMM with its
activation quantization (`fp8_block_linear`), the GEMM alone (`block_fp8_gemm`), bf16
`F.linear` and the per-channel FP8 path as served (`fp8_linear`); then Qwen3.6-35B-A3B's
block-FP8 routed experts (`MoEExperts`, H 2048, I 512, E 256, top-8) against the same experts
in bf16. Each figure is the mean GPU time of a graph replay (`bench/gpu_timing.py`). Prints a
table and writes the figures as JSON. The tile table it measures is `fp8_block_gemm._GEMM_TILES`.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.modules.fp8_linear import fp8_linear, quantize_fp8_rows
from tensorrt_llm._torch.modules.fused_moe import MoEExperts, softmax_topk
from tensorrt_llm._torch.modules.triton_kernels import fp8_block as fb
from tensorrt_llm._torch.modules.triton_kernels import fp8_block_gemm as fbg
from tensorrt_llm.bench.gpu_timing import graph_time_us

_SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288))
_ROWS = (1, 8, 32, 64, 128, 256, 1024, 4096)
_MOE_TOKENS = (1, 8, 32, 64, 128, 256)


def _gemm_rows(rows: tuple[int, ...]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for name, n, k in _SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = fb.quantize_weight_fp8_block(w)
        cq, cs = quantize_fp8_rows(w)
        cs = cs.view(-1).contiguous()
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = fb.per_token_group_quant_fp8(x)
            t = {
                "fp8_block": graph_time_us(partial(fb.fp8_block_linear, x, wq, ws)),
                "fp8_block gemm": graph_time_us(
                    partial(fb.block_fp8_gemm, xq, xs, wq, ws, torch.bfloat16)
                ),
                "bf16": graph_time_us(partial(F.linear, x, w)),
                "fp8 per-channel": graph_time_us(partial(fp8_linear, x, cq, cs, None)),
            }
            tiles = fbg.gemm_tiles(m)
            splits, _ = fbg.split_k_plan(tiles, n, -(-k // 128), fbg.num_sms(x.device))
            row = {"shape": name, "n": n, "k": k, "m": m, "splits": splits, "us": t}
            print(f"{name:8s} M {m:5d} split {splits:2d} "
                  + "  ".join(f"{key} {v:8.1f}" for key, v in t.items()), flush=True)  # fmt: skip
            out.append(row)
    return out


def _moe_rows(tokens: tuple[int, ...]) -> list[dict[str, object]]:
    num, hidden, inter, top_k = 256, 2048, 512, 8
    bf16 = MoEExperts(num, hidden, inter, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        bf16.gate_up_proj.normal_(0, 0.02)
        bf16.down_proj.normal_(0, 0.02)
    fp8 = MoEExperts(num, hidden, inter, dtype=torch.bfloat16).cuda()
    fp8.load_state_dict(bf16.state_dict())
    fp8.quantize_fp8_block_()
    out: list[dict[str, object]] = []
    for t in tokens:
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = softmax_topk(torch.randn(t, num, device="cuda"), top_k)
        weights = weights.bfloat16()
        times = {
            "fp8_block": graph_time_us(partial(fp8, x, ids, weights)),
            "bf16": graph_time_us(partial(bf16, x, ids, weights)),
        }
        print(f"moe T {t:5d} " + "  ".join(f"{k} {v:8.1f}" for k, v in times.items()), flush=True)
        out.append({"tokens": t, "us": times})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(_ROWS))
    p.add_argument("--moe-tokens", type=int, nargs="+", default=list(_MOE_TOKENS))
    p.add_argument("--output", help="write the figures as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_block.py needs a GPU")
    result = {
        "device": torch.cuda.get_device_name(),
        "tiles": [t.__dict__ for t in fbg._GEMM_TILES],
        "gemm": _gemm_rows(tuple(args.rows)),
        "moe": _moe_rows(tuple(args.moe_tokens)),
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
