"""Measure launch alternatives of the block-FP8 GEMM (GPU only), to choose `_GEMM_TILES`.

    python benchmarks/tune_fp8_block.py --output tune.json [--rows 1 32 128 ...]

For each row count M and each projection shape of Qwen3-VL-8B and Qwen3.6-27B, times (CUDA
graph replays, `bench/gpu_timing.py`) every Triton launch of `_candidates(M)` (tiles, stages,
split-K, row grouping), the table's own choice, cuBLASLt's block-scaled GEMM
(`fp8_block_cublas.py`) and the per-channel FP8 GEMM as served. The weights rotate over
enough copies to exceed the L2 cache, as consecutive layers do. Prints, per M, the best
candidate per shape and the candidate with the least total time over all shapes, and writes
every figure as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from functools import partial

import torch

from tensorrt_llm._torch.modules.fp8_block_cublas import cublas_block_fp8_gemm, cublas_unsupported
from tensorrt_llm._torch.modules.fp8_linear import fp8_linear, quantize_fp8_rows
from tensorrt_llm._torch.modules.triton_kernels import fp8_block as fb
from tensorrt_llm._torch.modules.triton_kernels import fp8_block_gemm as fbg
from tensorrt_llm.bench.gpu_timing import graph_time_us

# (name, N, K): Qwen3-VL-8B's qkv, o, gate_up, down; Qwen3.6-27B's MLP and GDN input.
_SHAPES = (
    ("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096), ("8b.gate_up", 24576, 4096),
    ("8b.down", 4096, 12288), ("27b.gate_up", 34816, 5120), ("27b.down", 5120, 17408),
    ("27b.qkvz", 16384, 5120),
)  # fmt: skip
_ROWS = (1, 16, 32, 64, 128, 256, 1024, 4096)
_L2_BYTES = 64 << 20


def _candidates(rows: int) -> list[tuple[fbg.GemmTiles, int | None]]:
    """(tiles, splits; None = the plan's own) worth trying at `rows` rows."""
    out: list[tuple[fbg.GemmTiles, int | None]] = []
    if rows <= 64:
        block_ms = sorted({16, min(64, max(16, 1 << (rows - 1).bit_length()))})
        for bm, bn, stages in itertools.product(block_ms, (32, 64, 128), (3, 4, 5)):
            for splits in (None, 1, 2, 4, 8):
                out.append((fbg.GemmTiles(rows, bm, bn, 4, stages, True), splits))
        # Swapped operands: BLOCK_N weight rows on the MMA's long side, the tokens on its short.
        tokens = max(16, 1 << (rows - 1).bit_length())
        for bn, warps, stages in itertools.product((64, 128), (4, 8), (3, 4, 5, 6)):
            if warps == 8 and bn == 64:
                continue
            for splits in (None, 1, 2, 4, 8):
                tiles = fbg.GemmTiles(rows, tokens, bn, warps, stages, True, swap_ab=True)
                out.append((tiles, splits))
    elif rows <= 256:
        grid = itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
        for bm, bn, warps, stages in grid:
            if bm * bn > 128 * 128 or (warps == 8 and bm * bn < 64 * 128):
                continue
            for splits in (None, 1, 2):
                out.append((fbg.GemmTiles(rows, bm, bn, warps, stages, True), splits))
    else:
        grid = itertools.product((64, 128), (128, 256), (4, 8), (3, 4, 5), (1, 8))
        for bm, bn, warps, stages, group in grid:  # type: ignore[assignment]
            if bm * bn > 128 * 256 or (bm, bn, warps) == (64, 128, 8):
                continue
            out.append((fbg.GemmTiles(rows, bm, bn, warps, stages, False, group), 1))
    return out


def _label(tiles: fbg.GemmTiles, splits: int | None) -> str:
    s = "plan" if splits is None else str(splits)
    swap = " swap" if tiles.swap_ab else ""
    return (f"m{tiles.block_m} n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages} "
            f"g{tiles.group_m} k{s}{swap}")  # fmt: skip


def _rotating(fn: Callable[..., object], per_copy: list[tuple], *args: object) -> float | None:
    """GPU microseconds of one `fn(*per_copy[i], *args)`, averaged over the copies (different
    weights), or None when the launch fails (a tile past shared memory, a layout refused)."""
    calls = [partial(fn, *head, *args) for head in per_copy]

    def run() -> None:
        for call in calls:
            call()

    try:
        return graph_time_us(run, iters=20) / len(calls)
    except Exception as e:
        print(f"    skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        return None


def _shape_rows(name: str, n: int, k: int, rows: tuple[int, ...]) -> list[dict[str, object]]:
    copies = max(1, min(8, -(-_L2_BYTES // (n * k))))
    ws = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
    blocks = [fb.quantize_weight_fp8_block(w) for w in ws]
    chan = [(q, s.view(-1).contiguous()) for q, s in map(quantize_fp8_rows, ws)]
    del ws
    gemm, block, bf16 = fbg.triton_block_fp8_gemm, (128, 128), torch.bfloat16
    out: list[dict[str, object]] = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = fb.per_token_group_quant_fp8(x)
        xq_mm, xs_mm = fb.per_token_group_quant_fp8(x, m_major=True)
        row_major = [(xq, xs, *b) for b in blocks]
        m_major = [(xq_mm, xs_mm, *b) for b in blocks]
        t: dict[str, float | None] = {
            "per-channel fp8 linear": _rotating(fp8_linear, [(x, *c) for c in chan], None),
            "group quant": graph_time_us(partial(fb.per_token_group_quant_fp8, x)),
            "table": _rotating(gemm, row_major, bf16, block),
            "table, m-major scales": _rotating(gemm, m_major, bf16, block),
        }
        if cublas_unsupported(x.device, n, k, block) is None:
            t["cublas"] = _rotating(cublas_block_fp8_gemm, m_major, bf16)
        for tiles, splits in _candidates(m):
            t[_label(tiles, splits)] = _rotating(gemm, row_major, bf16, block, None, tiles, splits)
        cands = {key: v for key, v in t.items() if key[0] == "m" and v is not None}
        best = min(cands, key=lambda key: cands[key]) if cands else None
        fixed = ("per-channel fp8 linear", "group quant", "table", "cublas")
        print(f"{name:12s} M {m:5d} best {best} {cands.get(best or '', 0):8.1f} us | "
              + "  ".join(f"{key} {t[key]:.1f}" for key in fixed if t.get(key) is not None),
              flush=True)  # fmt: skip
        out.append({"shape": name, "n": n, "k": k, "m": m, "copies": copies, "us": t})
    return out


def _summary(results: list[dict[str, object]]) -> dict[int, dict[str, object]]:
    """Per M: the candidate with the least total time over the shapes that ran them all."""
    summary: dict[int, dict[str, object]] = {}
    for m in sorted({int(r["m"]) for r in results}):  # type: ignore[call-overload]
        rows = [r for r in results if r["m"] == m]
        totals: dict[str, float] = {}
        for key in rows[0]["us"]:  # type: ignore[attr-defined]
            vals = [r["us"].get(key) for r in rows]  # type: ignore[attr-defined]
            if all(v is not None for v in vals):
                totals[key] = sum(vals)
        cands = {k: v for k, v in totals.items() if k[0] == "m"}
        best = min(cands, key=lambda k: cands[k])
        summary[m] = {"best": best, "totals": totals}
        fixed = ("per-channel fp8 linear", "table", "cublas")
        print(
            f"M {m:5d} total: best {best} {cands[best]:.1f} us | "
            + "  ".join(f"{k} {totals[k]:.1f}" for k in fixed if k in totals),
            flush=True,
        )
    return summary


def _producer_rows(rows: tuple[int, ...]) -> list[dict[str, object]]:
    """The activation hand-offs of a block-FP8 layer (Qwen3-VL-8B sizes): RMSNorm (+ residual)
    then group quantisation vs the fused kernel, and SwiGLU then quantisation vs fused."""
    from tensorrt_llm._torch.modules.triton_kernels.activation import (
        silu_and_mul,
        silu_and_mul_group_quant,
    )
    from tensorrt_llm._torch.modules.triton_kernels.rms_norm import rms_norm, rms_norm_quant_fp8

    out: list[dict[str, object]] = []
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for m in rows:
        x, res = (torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gate_up = torch.randn(m, 24576, device="cuda", dtype=torch.bfloat16)
        pad = m + (-m) % 16

        def norm_then_quant(x=x, res=res, pad=pad) -> None:  # type: ignore[no-untyped-def]
            normed, _ = rms_norm(x, w, 1e-6, res)
            fb.per_token_group_quant_fp8(normed, m_major=True, rows_out=pad)

        def silu_then_quant(gate_up=gate_up, pad=pad) -> None:  # type: ignore[no-untyped-def]
            fb.per_token_group_quant_fp8(silu_and_mul(gate_up), m_major=True, rows_out=pad)

        t = {
            "norm + quant": graph_time_us(norm_then_quant),
            "norm fused": graph_time_us(
                partial(rms_norm_quant_fp8, x, w, 1e-6, res, False, pad, group=128)
            ),
            "norm alone": graph_time_us(partial(rms_norm, x, w, 1e-6, res)),
            "silu + quant": graph_time_us(silu_then_quant),
            "silu fused": graph_time_us(partial(silu_and_mul_group_quant, gate_up, 128, pad)),
            "silu alone": graph_time_us(partial(silu_and_mul, gate_up)),
        }
        print(f"producers M {m:5d} " + "  ".join(f"{k} {v:.1f}" for k, v in t.items()), flush=True)
        out.append({"m": m, "us": t})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(_ROWS))
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in _SHAPES])
    p.add_argument("--output", help="write the figures as JSON here")
    p.add_argument("--producers", action="store_true", help="time the fused hand-offs first")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_fp8_block.py needs a GPU")
    start = time.time()
    results: list[dict[str, object]] = []
    producers = _producer_rows(tuple(args.rows)) if args.producers else []
    for name, n, k in _SHAPES:
        if name in args.shapes:
            results += _shape_rows(name, n, k, tuple(args.rows))
            print(f"-- {name} done at {time.time() - start:.0f} s", flush=True)
            if args.output:
                with open(args.output, "w") as f:
                    out = {"device": torch.cuda.get_device_name(), "gemm": results}
                    json.dump({**out, "producers": producers}, f)
    summary = _summary(results)
    if args.output:
        with open(args.output, "w") as f:
            out = {"device": torch.cuda.get_device_name(), "gemm": results, "summary": summary}
            json.dump({**out, "producers": producers}, f, indent=1)


if __name__ == "__main__":
    main()
