"""Compile Triton kernels for sm_90 (H100/H200) on any machine; run by
`test_kernels_compile_for_hopper.py` in a subprocess without TRITON_INTERPRET (under the
interpreter `triton.jit` yields interpreted functions, which cannot be compiled).

Triton's wheel ships ptxas, so this checks, without a GPU, that the kernel variants listed in
`_variants` (the launch configurations the GPU path uses, taken from the launchers' own tile
choices where they have one) lower all the way to a cubin: unsupported ops, dtype mismatches in
`tl.dot` or bad constexpr plumbing fail here instead of on the GPU machine. Add a kernel here
when it changes between GPU sessions. Prints one line per variant: `ok <name> <shared bytes>`
or `FAIL <name> <error>`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tensorrt_llm._torch.attention_backend.triton_kernels import decode, kv_store, prefill
from tensorrt_llm._torch.modules.triton_kernels import (
    activation,
    conv_rollback,
    fp8_block,
    fp8_block_gemm,
    fp8_quant,
    fp8_scale,
    fused_moe,
    gated_rms_norm,
    gdn_decode,
    moe_gemv,
    moe_routing,
    moe_tiles,
    mrope,
    rms_norm,
)
from tensorrt_llm._torch.modules.triton_kernels import causal_conv1d as gdn_conv

_HOPPER = GPUTarget("cuda", 90, 32)


# Arguments the block-FP8 kernels see divisible by 16 at run time (Triton specializes aligned
# pointers, and sizes / strides that are multiples of 16), so their loads pipeline here as on
# the GPU; a variant compiled without these would show single-stage shared memory.
_DIVISIBLE = ("depth", "cols", "stride_am", "stride_bn", "stride_asm", "stride_bsn", "stride_cm")


def _compile(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], **options: Any):
    names = kernel.arg_names
    divisible = options.pop("divisible", False)
    if "USE_PDL" in names:
        constexprs = {"USE_PDL": False, **constexprs}
    signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in names}
    attrs = None
    if divisible:
        hinted = [n for n in names if signature[n].startswith("*") or n in _DIVISIBLE]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs=attrs,
    )
    return triton.compile(src, target=_HOPPER, options=options or None)


def _variants() -> Iterator[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    rope_types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "q_w_ptr", "k_w_ptr")}
    rope_types.update(table_ptr="*fp32", pos_ptr="*i32", axes_ptr="*i32", flag_ptr="*i32")
    rope_types["eps"] = "fp32"
    # (head_dim, half of rotary_dim, zero-centered, positions looked up in the kernel)
    for head_dim, half, zero_centered, has_pos in ((128, 64, False, False), (256, 32, True, True)):
        cx = dict(
            HALF=half, BLOCK_HALF=half, BLOCK_HEADS=16, HAS_POS=has_pos, HAS_AXES=has_pos,
            HAS_FLAG=has_pos, HEAD_DIM=head_dim, BLOCK_D=head_dim, NORM=True,
            ZERO_CENTERED=zero_centered,
        )  # fmt: skip
        yield f"rope_qk+norm d{head_dim}", mrope._rope_qk_kernel, rope_types, cx, {}

    quant_types = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32")
    yield "fp8 row quant", fp8_quant._quant_rows_kernel, quant_types, dict(BLOCK=4096), {}

    scale_types = dict(out_ptr="*bf16", a_ptr="*fp32", b_ptr="*fp32", bias_ptr="*bf16")
    for has_bias in (False, True):
        cx = dict(HAS_BIAS=has_bias, BLOCK_N=1024)
        yield f"fp8 scale_outer bias={has_bias}", fp8_scale._scale_outer_kernel, scale_types, cx, {}
    act_types = dict(x_ptr="*bf16", out_ptr="*bf16", row_scale_ptr="*fp32", col_scale_ptr="*fp32")
    act_types.update(scale_ptr="*fp32")
    # (gate_up scaled on load, block-FP8 group of the e4m3 output, columns per program)
    for scaled, group, block in ((False, 0, 1024), (True, 0, 1024), (False, 128, 1024),
                                 (False, 128, 512)):  # fmt: skip
        types = dict(act_types, out_ptr="*fp8e4nv") if group else act_types
        cx = dict(SCALED=scaled, QUANT_GROUP=group, BLOCK=block)
        name = f"silu_and_mul scaled={scaled} group={group} block={block}"
        yield name, activation._silu_and_mul_kernel, types, cx, {}

    dec_types = dict(
        q_ptr="*bf16", out_ptr="*bf16", part_acc_ptr="*fp32", part_ml_ptr="*fp32",
        block_tables_ptr="*i32", seq_lens_ptr="*i32", num_cached_ptr="*i32", qk_scale="fp32",
    )  # fmt: skip
    for cache, dtype, head_dim, qk_fp8 in (
        ("bf16", torch.bfloat16, 128, False),
        ("bf16", torch.bfloat16, 256, False),
        ("fp8e4nv", torch.float8_e4m3fn, 128, False),
        ("fp8e4nv", torch.float8_e4m3fn, 128, True),
    ):
        tiles = decode._tile_config(head_dim, dtype, True)  # what the GPU path launches
        fp8 = dtype == torch.float8_e4m3fn
        for split in (False, True):
            cx = dict(
                TOKENS_PER_BLOCK=32, GROUP=4, GROUP_P=16, HEAD_DIM=head_dim,
                BLOCK_D=tiles.block_d, BLOCK_N=tiles.block_n, SPLIT=split, DOT_PRECISION="tf32",
                DOT_F16=fp8 and (tiles.fp16_dot or qk_fp8), QK_FP8=qk_fp8,
            )  # fmt: skip
            opts = dict(num_stages=tiles.num_stages, num_warps=tiles.num_warps)
            name = f"decode {cache} d{head_dim} split={split} qk_fp8={qk_fp8}"
            yield (
                name,
                decode._decode_split_kernel,
                {**dec_types, "cache_ptr": f"*{cache}"},
                cx,
                opts,
            )


def _more_variants() -> Iterator[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """Kernels that ran on the GPU already (the RMSNorm's e4m3-output and scaled-input
    variants have not): kept here so a later change cannot break their GPU compile
    unnoticed."""
    norm_types = {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "new_res_ptr")}
    norm_types.update(eps="fp32", q_ptr="*fp8e4nv", scale_ptr="*fp32")
    norm_types.update(x_row_scale_ptr="*fp32", x_col_scale_ptr="*fp32")
    # (residual, zero-centered, rows per program, width, e4m3 output for an FP8 linear,
    #  input scaled on load)
    #  input scaled on load, block-FP8 group of the e4m3 output)
    for has_res, zero_centered, block_rows, width, quant, scaled, group in (
        (True, False, 1, 4096, False, False, 0),
        (False, True, 16, 256, False, False, 0),
        (True, False, 1, 4096, True, False, 0),
        (False, False, 1, 4096, True, False, 0),
        (True, False, 1, 4096, True, True, 0),
        (True, False, 1, 4096, False, True, 0),
        (True, False, 1, 4096, True, False, 128),
        (True, True, 2, 2048, True, False, 128),
        (True, False, 1, 8192, True, False, 128),
    ):
        cx = dict(
            BLOCK_ROWS=block_rows, BLOCK_D=width, HAS_RES=has_res, ZERO_CENTERED=zero_centered,
            QUANT=quant, QUANT_GROUP=group, X_SCALED=scaled,
        )  # fmt: skip
        yield (
            f"rms_norm res={has_res} zc={zero_centered} quant={quant} scaled={scaled} "
            f"group={group} d={width}",
            rms_norm._rms_norm_kernel,
            norm_types,
            cx,
            {},
        )

    for cache in ("bf16", "fp8e4nv"):
        types = dict(k_ptr="*bf16", v_ptr="*bf16", cache_ptr=f"*{cache}", slot_ptr="*i32")
        cx = dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, SATURATE=cache != "bf16")
        yield f"store_kv {cache}", kv_store._store_kv_kernel, types, cx, {}

        block_m, block_n, warps = prefill._tile_sizes(128, torch.device("cuda"))
        types = dict(
            q_ptr="*bf16", out_ptr="*bf16", cache_ptr=f"*{cache}", block_tables_ptr="*i32",
            seq_lens_ptr="*i32", num_cached_ptr="*i32", cu_seqlens_ptr="*i32", qk_scale="fp32",
        )  # fmt: skip
        cx = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=block_m, BLOCK_N=block_n,
                  DOT_PRECISION="tf32")  # fmt: skip
        yield f"prefill {cache}", prefill._prefill_kernel, types, cx, dict(num_warps=warps)

    gdn_types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "o_ptr")}
    gdn_types.update(state_ptr="*fp32", slots_ptr="*i64", cu_ptr="*i64", scale="fp32", eps="fp32")
    gdn_types.update(a_log_ptr="*bf16", dt_bias_ptr="*bf16")
    # The MTP replay's inputs (token index, saved states and their rows): runtime flags.
    gdn_types.update(tok_ptr="*i64", init_ptr="*fp32", init_rows_ptr="*i64")
    # rows: each program loops over a row's tokens (MTP verify rows, gated_delta_net_rows.py).
    # Decode takes 64 value columns from 1024 request-heads on (`gdn_decode._block_v`).
    for raw, rows, block_v in (
        (False, False, 32), (True, False, 32), (True, False, 64), (True, True, 32),
        (False, True, 32),
    ):  # fmt: skip
        cx = dict(
            RATIO=3, K=128, V=128, BLOCK_K=128, BLOCK_V=block_v,
            L2NORM=True, RAW_GATES=raw, ROWS=rows,
        )  # fmt: skip
        types = gdn_types if raw else dict(gdn_types, g_ptr="*fp32")
        yield (
            f"gated delta rule decode raw_gates={raw} rows={rows} block_v={block_v}",
            gdn_decode._gdn_decode_kernel,
            types,
            cx,
            {},
        )
    # Gated DeltaNet's conv1d (Qwen3.6-27B: 10240 channels, width 4) and gated RMSNorm.
    conv_types = {n: "*bf16" for n in ("x_ptr", "w_ptr", "bias_ptr", "state_ptr", "out_ptr")}
    conv_types.update(slots_ptr="*i64")
    for bias, slots in ((False, True), (True, False)):
        cx = dict(
            WIDTH=4, BLOCK_C=gdn_conv._UPDATE_BLOCK_C, HAS_BIAS=bias, HAS_SLOTS=slots, SILU=True
        )
        name = f"conv1d update bias={bias} slots={slots}"
        yield name, gdn_conv._conv_update_kernel, conv_types, cx, {}
    varlen_types = {n: "*bf16" for n in ("x_ptr", "w_ptr", "bias_ptr", "init_ptr", "final_ptr")}
    varlen_types.update(
        out_ptr="*bf16", has_init_ptr="*i32", final_rows_ptr="*i64", cu_ptr="*i32",
        block_seq_ptr="*i32", block_tok_ptr="*i32",
    )  # fmt: skip
    # planes: q, k, v written as three contiguous planes (the layer's prefill).
    for init, rows, planes in ((False, False, False), (True, True, False), (True, True, True)):
        cx = dict(
            WIDTH=4, BLOCK_T=gdn_conv._VARLEN_BLOCK_T, BLOCK_C=gdn_conv._VARLEN_BLOCK_C,
            HAS_BIAS=init, HAS_INIT=init, HAS_ROWS=rows, SILU=True, PLANES=planes,
        )  # fmt: skip
        name = f"conv1d varlen init={init} rows={rows} planes={planes}"
        yield name, gdn_conv._conv_varlen_kernel, varlen_types, cx, {}
    # The MTP rollback's conv state (conv_rollback.py): bf16 pool rows, saved rows, inputs.
    rollback_types = {n: "*bf16" for n in ("pool_ptr", "init_ptr", "x_ptr")}
    rollback_types.update(
        slots_ptr="*i64", init_rows_ptr="*i64", starts_ptr="*i64", keeps_ptr="*i64"
    )
    cx = dict(WIDTH=4, BLOCK_C=conv_rollback._BLOCK_C)
    yield "conv1d rollback", conv_rollback._conv_rollback_kernel, rollback_types, cx, {}
    norm_types = {n: "*bf16" for n in ("x_ptr", "z_ptr", "w_ptr", "out_ptr")}
    norm_types["eps"] = "fp32"
    for round_y in (False, True):
        cx = dict(BLOCK_ROWS=16, BLOCK_D=128, ROUND_Y=round_y)
        yield (
            f"gated rms norm round_y={round_y}",
            gated_rms_norm._gated_rms_norm_kernel,
            norm_types,
            cx,
            {},
        )


def _fp8_block_variants() -> Iterator[
    tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]
]:
    """Block-FP8 (1 x 128 activation groups, 128 x 128 weight blocks): the group quantisation,
    every M bucket of the GEMM's tile table (direct bf16 output and split-K fp32 partials),
    the split-K sum, and the block-scaled grouped-GEMM MoE kernels."""
    quant_types = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32")
    cx = dict(GROUP=128, GROUP_P=128, GROUPS_PER_PROG=16)
    yield "fp8_block group quant", fp8_block._group_quant_kernel, quant_types, cx, dict(num_warps=8)
    gemm_types = dict(
        a_ptr="*fp8e4nv", a_scale_ptr="*fp32", b_ptr="*fp8e4nv", b_scale_ptr="*fp32",
        bias_ptr="*bf16",
    )  # fmt: skip
    swapped = [
        fp8_block_gemm.GemmTiles(m, m, n, w, st, True, swap_ab=True)
        for m, n, w, st in ((16, 64, 4, 4), (16, 128, 4, 5), (32, 128, 8, 4), (64, 128, 4, 3))
    ]
    for tiles in (*fp8_block_gemm._GEMM_TILES, *swapped):
        for out, bn, has_bias in (("bf16", 128, False), ("fp32", 128, False), ("bf16", 1, True)):
            if out == "fp32" and not tiles.split_k:
                continue
            cx = dict(
                W_BLOCK_N=bn, HAS_BIAS=has_bias, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                BLOCK_K=128,
            )  # fmt: skip
            if tiles.swap_ab:
                kernel = fp8_block_gemm._block_fp8_gemm_swap_kernel
            else:
                kernel, cx = fp8_block_gemm._block_fp8_gemm_kernel, {**cx, "GROUP_M": tiles.group_m}
            opts = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages, divisible=True)
            name = (f"fp8_block gemm m<={tiles.max_rows} bm={tiles.block_m} bn={tiles.block_n} "
                    f"swap={tiles.swap_ab} out={out} wbn={bn} bias={has_bias}")  # fmt: skip
            types = {**gemm_types, "c_ptr": f"*{out}"}
            yield name, kernel, types, cx, opts
    sum_types = dict(part_ptr="*fp32", out_ptr="*bf16", bias_ptr="*bf16")
    yield (
        "fp8_block split-k sum",
        fp8_block_gemm._split_k_sum_kernel,
        sum_types,
        dict(HAS_BIAS=True, BLOCK=1024),
        {},
    )
    # Qwen3.6-35B-A3B's experts (H 2048, I 512, top-8), both BLOCK_M choices of the launcher,
    # block-FP8 and 16-bit (whose kernels now take the unused scale arguments).
    for scaled, block_m in ((True, 16), (True, 64), (False, 16)):
        w = "*fp8e4nv" if scaled else "*bf16"
        base = dict(sorted_ptr="*i32", block_expert_ptr="*i32", w_ptr=w, w_scale_ptr="*fp32")
        cx = dict(
            BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128 if scaled else 64, PRECISION="tf32",
            BLOCK_SCALED=scaled, W_BLOCK_N=128, HIDDEN=2048, INTER=512,
        )  # fmt: skip
        types = dict(base, x_ptr=w, out_ptr="*bf16", x_scale_ptr="*fp32")
        name = f"fused_moe gate_up scaled={scaled} m{block_m}"
        yield name, fused_moe._gate_up_silu_kernel, types, {**cx, "TOP_K": 8}, {}
        types = dict(base, act_ptr=w, out_ptr="*fp32", topk_w_ptr="*bf16", act_scale_ptr="*fp32")
        for atomic in (False, True):
            name = f"fused_moe down scaled={scaled} m{block_m} atomic={atomic}"
            cx_down = {**cx, "TOP_K": 9, "ATOMIC": atomic}
            yield name, fused_moe._down_weighted_kernel, types, cx_down, {}


def _moe_variants() -> Iterator[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """Qwen3.6-35B-A3B's MoE at decode: routing (256 experts + the fused shared one, top-8),
    the alignment, the GEMV kernels, and the grouped GEMMs at every tile of the table."""
    route_types = dict(logits_ptr="*bf16", ids_ptr="*i32", weights_ptr="*bf16")
    cx = dict(NUM_EXPERTS=256, TOP_K=8, RENORMALIZE=True, SHARED=True, BLOCK_E=512, BLOCK_K=16)
    yield "moe route", moe_routing._route_kernel, route_types, cx, {}
    align_types = dict(ids_ptr="*i32", base_ptr="*i32", sorted_ptr="*i32",
                       block_expert_ptr="*i32")  # fmt: skip
    for block_m in (16, 64):
        cx = dict(NUM_EXPERTS=257, BLOCK_M=block_m, BLOCK_E=512, BLOCK_P=128, BLOCK_H=1024,
                  BLOCK_R=1024)  # fmt: skip
        yield f"moe align m{block_m}", moe_routing._align_kernel, align_types, cx, dict(num_warps=8)
    g = moe_tiles.GEMV_TILES
    gu_types = dict(x_ptr="*bf16", w_ptr="*bf16", ids_ptr="*i32", act_ptr="*bf16")
    cx = dict(HIDDEN=2048, INTER=512, TOP_K=9, BLOCK_N=g.gate_up_n, BLOCK_K=g.block_k)
    yield "moe gemv gate_up", moe_gemv._gemv_gate_up_kernel, gu_types, cx, {}
    for rows, out in ((1, "*fp32"), (9, "*bf16")):
        dn_types = dict(act_ptr="*bf16", w_ptr="*bf16", ids_ptr="*i32", topk_w_ptr="*bf16",
                        out_ptr=out)  # fmt: skip
        cx = dict(HIDDEN=2048, INTER=512, ROW_PAIRS=rows, BLOCK_N=g.down_n, BLOCK_K=g.block_k)
        yield f"moe gemv down rows={rows}", moe_gemv._gemv_down_kernel, dn_types, cx, {}
    sum_types = dict(part_ptr="*fp32", out_ptr="*bf16")
    cx = dict(HIDDEN=2048, TOP_K=9, BLOCK=1024)
    yield "moe gemv k-sum", moe_gemv._sum_pairs_kernel, sum_types, cx, {}
    base = dict(sorted_ptr="*i32", block_expert_ptr="*i32", w_ptr="*bf16", w_scale_ptr="*fp32")
    for bound, t in moe_tiles.TILE_TABLE:
        opts = dict(num_warps=t.num_warps, num_stages=t.num_stages)
        common = dict(BLOCK_M=t.block_m, PRECISION="tf32", BLOCK_SCALED=False, W_BLOCK_N=1,
                      HIDDEN=2048, INTER=512, TOP_K=9)  # fmt: skip
        types = dict(base, x_ptr="*bf16", out_ptr="*bf16", x_scale_ptr="*fp32")
        cx = dict(common, BLOCK_N=t.gate_up_n, BLOCK_K=t.gate_up_k)
        yield f"moe table<={bound} gate_up", fused_moe._gate_up_silu_kernel, types, cx, opts
        types = dict(base, act_ptr="*bf16", out_ptr="*fp32", topk_w_ptr="*bf16",
                     act_scale_ptr="*fp32")  # fmt: skip
        cx = dict(common, BLOCK_N=t.down_n, BLOCK_K=t.down_k, ATOMIC=t.combine == "atomic")
        yield f"moe table<={bound} down", fused_moe._down_weighted_kernel, types, cx, opts


def _pdl_variants() -> Iterator[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """Every kernel that takes USE_PDL, compiled with it on (grid-dependency instructions and
    Triton's `launch_pdl` option), as decode-sized launches run on Hopper by default."""
    every = [*_variants(), *_more_variants(), *_fp8_block_variants(), *_moe_variants()]
    for name, kernel, types, cx, opts in every:
        if "USE_PDL" in kernel.arg_names and "split=True" not in name:
            yield (
                f"{name} +pdl",
                kernel,
                types,
                {**cx, "USE_PDL": True},
                {**opts, "launch_pdl": True},
            )
    reduce_types = dict(out_ptr="*bf16", part_acc_ptr="*fp32", part_ml_ptr="*fp32")
    cx = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=decode._BLOCK_SPLITS, USE_PDL=True)
    yield "decode reduce +pdl", decode._decode_reduce_kernel, reduce_types, cx, {"launch_pdl": True}


def main() -> int:
    failed = 0
    every = [
        *_variants(),
        *_more_variants(),
        *_fp8_block_variants(),
        *_moe_variants(),
        *_pdl_variants(),
    ]
    for name, kernel, types, cx, opts in every:
        try:
            compiled = _compile(kernel, types, cx, **opts)
            if "cubin" not in compiled.asm:
                raise RuntimeError("no cubin produced")
            if name.endswith("+pdl") and "griddepcontrol.wait" not in compiled.asm["ptx"]:
                raise RuntimeError("USE_PDL=True compiled without griddepcontrol.wait")
            print(f"ok {name} {compiled.metadata.shared}", flush=True)
        except Exception as exc:  # report every variant, then fail
            failed += 1
            print(f"FAIL {name} {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
