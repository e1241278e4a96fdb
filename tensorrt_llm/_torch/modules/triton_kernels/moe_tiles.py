"""Tile choice of the fused MoE kernels by the number of (token, expert) pairs of a step.

Decode at small batch is memory bound: every pair's expert weights stream once, and the grid
must give each SM enough programs to keep its loads in flight. At batch 1 the 8 (+1 shared)
pairs make 9 M-blocks, so `gate_up` with 64-wide N tiles launches only 9 x 8 programs on an
H200's 132 SMs; narrower N tiles multiply the programs. Large batches want wide tiles (fewer
re-reads of x, bigger dots). `benchmarks/bench_moe.py` times the candidates on the GPU; the
table below holds its choice per bucket of pairs.

`GEMV_MAX_TOKENS`: at most this many tokens take the GEMV kernels (`moe_gemv.py`, no layout,
no padding to BLOCK_M, the k-sum fused into the down kernel) instead of the grouped GEMM.
`combine`: "sum" writes `[T*k, H]` in the activation dtype and sums over k in fp32
(deterministic); "atomic" adds each pair into a zeroed `[T, H]` fp32 with atomics (the sum
order varies run to run, so results can differ in the last bit between runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MoETiles:
    block_m: int
    gate_up_n: int
    gate_up_k: int
    down_n: int
    down_k: int
    num_warps: int = 4
    num_stages: int = 3
    combine: str = "sum"
    down_num_warps: int | None = None  # the down kernel's warps (None: num_warps)

    def __post_init__(self) -> None:
        for name in ("block_m", "gate_up_n", "gate_up_k", "down_n", "down_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoETiles.{name} must be a power of two >= 16, got {v}")
        if self.down_num_warps is not None and self.down_num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MoETiles.down_num_warps must be 1-16, a power of two, got "
                             f"{self.down_num_warps}")  # fmt: skip
        if self.combine not in ("sum", "atomic"):
            raise ValueError(f"MoETiles.combine must be 'sum' or 'atomic', got {self.combine!r}")


@dataclass(frozen=True)
class GemvTiles:
    gate_up_n: int = 16
    down_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    down_per_pair: bool = True  # moe_gemv.py: k times the programs, plus a k-sum launch


# (largest token count of the bucket, tiles); the last bucket takes every larger step. Buckets
# end at powers of two: the warm-up runs one step per power-of-two token class
# (pyexecutor/warmup_shapes.py), so every tile variant compiles before serving.
# From `benchmarks/bench_moe.py` on the H200 at Qwen3.6-35B-A3B sizes (8+1 pairs per token; the
# 1 << 62 bucket is not measured yet): K tiles of 128 (4 stages) won at 4, 16 and 64 tokens
# (16 tokens: 167.7 us for gate_up + down against 181.8 us with 64 / 64 / 3 stages). At 1 and
# 4 tokens the GEMV path is within 1-2 us of the best grouped tiles and needs no alignment.
TILE_TABLE: tuple[tuple[int, MoETiles], ...] = (
    (8, MoETiles(16, 64, 128, 64, 128, num_warps=4, num_stages=4)),
    (64, MoETiles(16, 64, 128, 64, 128, num_warps=4, num_stages=4)),
    # 3 stages: a step of more than ~114 tokens takes BLOCK_M 64 (`pick_tiles`), where 4 stages
    # of gate and up tiles would need ~196 KB of shared memory. Down K tiles of 64: at 128
    # tokens (BLOCK_M 64) they took 151.2 us against 214.4 for K 128 (half the shared memory a
    # stage, twice the programs an SM holds); at 64 tokens (BLOCK_M 16) they tie (125.0 vs
    # 124.0). bench_moe at 08d3f23, bf16: block-FP8 experts take the scale block as K tile.
    (512, MoETiles(16, 64, 128, 64, 64, num_warps=4, num_stages=3)),
    (1 << 62, MoETiles(16, 64, 64, 64, 64, num_warps=4, num_stages=3)),
)
GEMV_TILES = GemvTiles()
# At most this many tokens (a power of two, see above) take the GEMV kernels;
# TRTLLM_MOE_GEMV_MAX_TOKENS=0 turns them off (A/B runs).
GEMV_MAX_TOKENS = int(os.environ.get("TRTLLM_MOE_GEMV_MAX_TOKENS", "4"))


def token_class(num_tokens: int) -> int:
    """The power of two >= num_tokens: tile choices depend on it only."""
    return 1 << max(num_tokens - 1, 0).bit_length()


# Block-FP8 experts in decode steps of 17 to this many tokens: BLOCK_M 16 (each expert's few
# pairs fill one M block; the "many pairs" rule of `pick_tiles` would take 64, most of it
# masked rows), 64-wide N, 4 warps, 3 stages for both kernels. `bench_moe.py
# --fp8_block_tokens 32 128 256` at Qwen3.6-35B-A3B sizes on an H100 (b1e3324; the K tile is
# the 128 scale block): gate_up + down took 187.5 / 284.2 / 294.6 us at 32 / 128 / 256 tokens
# against the table's 192.6 / 293.8 / 304.8 (BLOCK_M 16 and 4 stages at 32, BLOCK_M 64 above).
BLOCK_SCALED_DECODE_TILES = MoETiles(16, 64, 128, 64, 128, num_warps=4, num_stages=3)
BLOCK_SCALED_DECODE_TOKENS = (32, 256)
# Block-FP8 experts in steps of more than this many tokens: down N tiles of 256 with 8 warps.
# At Qwen3.6-35B-A3B sizes (8 + 1 pairs per token) and 8192 tokens the down GEMM with its k-sum
# took 718 us against 856 us for the table's 64-wide tiles on an H100; at 2048 tokens the
# table's won (213 vs 250 us). `bench_moe.py --prefill_fp8_tokens`.
BLOCK_SCALED_WIDE_DOWN_TOKENS = 4096


def pick_tiles(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    block_m: int | None = None,
    block_scaled: bool = False,
) -> MoETiles:
    """The table's tiles for a step of `num_tokens` tokens; `block_m` overrides the table's.

    A step with many more pairs than experts fills long runs, so it takes BLOCK_M 64 even in
    a small bucket (fewer re-reads of each expert's weights). `block_scaled`: block-FP8
    experts, whose K tile is the scale block; their decode steps take
    `BLOCK_SCALED_DECODE_TILES` and their large steps wider down tiles.
    """
    tokens = token_class(num_tokens)
    tiles = next(t for bound, t in TILE_TABLE if tokens <= bound)
    low, high = BLOCK_SCALED_DECODE_TOKENS
    if block_scaled and low <= tokens <= high:
        tiles = BLOCK_SCALED_DECODE_TILES
        return tiles if block_m is None else replace(tiles, block_m=block_m)
    if block_scaled and tokens > BLOCK_SCALED_WIDE_DOWN_TOKENS:
        tiles = replace(tiles, down_n=256, down_num_warps=8)
    if block_m is None and tokens * top_k > 4 * num_experts:
        block_m = 64
    return tiles if block_m is None else replace(tiles, block_m=block_m)
