"""Sweep the paged-decode kernel's tiles on the GPU: keys per tile, stages, warps, split count.

    python benchmarks/tune_decode.py --batch 32 128 --context 1500

Builds one layer's paged KV buffer at Qwen3-VL-8B attention sizes (32 query heads, 8 KV heads,
head dim 128) in bf16 and e4m3, times `paged_decode` with CUDA events for every candidate and
prints microseconds per call and the KV bytes it streams per second. The default tile
(`_tile_config`) is marked with `*`. GPU only.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial
from unittest import mock

import torch

from tensorrt_llm._torch.attention_backend.triton_kernels import decode
from tensorrt_llm.bench.gpu_timing import graph_time_us


def _buffers(batch: int, context: int, dtype: torch.dtype, tpb: int, heads: int, kv_heads: int):
    blocks_per_seq = -(-context // tpb)
    num_blocks = batch * blocks_per_seq
    kv = torch.randn(num_blocks, 2, tpb, kv_heads, 128, device="cuda").to(dtype)
    # Shuffled block ids: a served cache is not laid out request by request.
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.ones(batch, dtype=torch.int32, device="cuda")
    cached = torch.full((batch,), context - 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, 128, device="cuda", dtype=torch.bfloat16)
    return q, torch.empty_like(q), kv, tables, seq_lens, cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--max_seq_len", type=int, default=2008, help="static bound for the split count")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--block_n", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--kv_dtype", choices=["bf16", "fp8"], nargs="+", default=["bf16", "fp8"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_decode.py needs a GPU")
    heads, kv_heads, tpb = 32, 8, 32
    dtypes = [{"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[d] for d in args.kv_dtype]
    for dtype, batch in itertools.product(dtypes, args.batch):
        q, out, kv, tables, seq_lens, cached = _buffers(
            batch, args.context, dtype, tpb, heads, kv_heads
        )
        kv_bytes = 2 * batch * args.context * kv_heads * 128 * kv.element_size()
        default = decode._tile_config(128, dtype, True)
        auto_splits = decode.choose_num_splits(batch, kv_heads, args.max_seq_len)
        rows = []
        # Products for fp8 caches: in q's dtype, fp16, or e4m3 q @ k^T (+ fp16 p @ v).
        maths = ("q", "fp16", "qk_fp8") if dtype == torch.float8_e4m3fn else ("q",)
        # 256 keys only for 1-byte caches (a 32 KiB tile, like 128 bf16 keys).
        block_ns = [n for n in args.block_n if dtype == torch.float8_e4m3fn or n <= 128]
        for block_n, stages, warps, splits, math in itertools.product(
            block_ns,
            args.stages,
            args.warps,
            sorted({1, 2, auto_splits, 2 * auto_splits}),
            maths,
        ):
            tiles = decode.DecodeTiles(
                128, block_n, stages, warps, fp16_dot=math == "fp16", qk_fp8=math == "qk_fp8"
            )
            with mock.patch.object(decode, "_tile_config", lambda *_, t=tiles: t):
                try:
                    us = graph_time_us(
                        partial(
                            decode.paged_decode,
                            q,
                            out,
                            kv,
                            tables,
                            seq_lens,
                            cached,
                            0,
                            0.088,
                            splits,
                        ),
                        args.iters,
                    )
                except Exception as exc:  # out of shared memory and the like
                    print(f"  skip {tiles} splits={splits}: {type(exc).__name__}")
                    continue
            mark = "*" if tiles == default and splits == auto_splits else " "
            rows.append(
                (
                    us,
                    f"{mark} BLOCK_N={block_n:3d} stages={stages} warps={warps} "
                    f"splits={splits:2d} math={math:6s}: {us:8.1f} us  "
                    f"{kv_bytes / us / 1e6:6.2f} TB/s",
                )
            )
        print(f"{str(dtype).split('.')[-1]} batch {batch} context {args.context}:", flush=True)
        rows.sort()
        for _, line in rows[:10]:
            print(line)
        for _, line in rows[10:]:
            if line.startswith("*"):
                print(line, "(default)")
        print(flush=True)


if __name__ == "__main__":
    main()
