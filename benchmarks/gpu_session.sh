#!/bin/bash
# One stage of a GPU session on the lent H200 (../shared/docs/GPU.md): each `run` call sends
# the working tree and has at most 10 minutes, so a session is a few stages back to back.
#
#   bash benchmarks/gpu_session.sh STAGE [ARGS]    (on the GPU machine, from the repo root)
#
# Stages (logs and JSON under $OUT, each step under its own `timeout`):
#   tests-a/-b/-c       the GPU-marked test files in three thirds (the whole set needs ~15
#                       min); each stops itself at 500 s: give the `run` call timeout_s 560.
#                       The full log stays in $OUT; the tail names each failure (-rf).
#   mtpwarm             issue 20: no served MTP step compiles (test_warmup_gpu.py -k mtp, the two
#                       tiny Qwen3.5 checkpoints under TRTLLM_FAIL_ON_STEP_COMPILE=1)
#   std [TREE]          the standard Qwen3-VL-8B benchmark of the tree at TREE (default: .);
#                       an A/B runs it for `git archive BASE | tar -x -C ab_base` and for .
#   mt27                issue 19: Qwen3.6-27B multi-turn, block reuse on, then off
#   mt8                 issue 19: the same workload on Qwen3-VL-8B (bf16), reuse on, then off
#   mtp27 / mtp27c32 [TREE]  issue 20: Qwen3.6-27B MTP bounds at c=1 / c=32 (oracle, then
#                       rejected; env MODES, OSL, TAIL) for the tree at TREE (default .)
#   mtpgraphs           issue 20: the 27B MTP step (c=1 or env CONC, osl 256 or OSL, env MODE
#                       rejected or oracle) without the MTP CUDA graphs, with the verify
#                       graphs, + draft graphs, + rollback graphs
#                       (TRTLLM_MTP_{VERIFY,DRAFT,ROLLBACK}_GRAPHS; env GRAPHS picks: "110 111",
#                       "nospec" the baseline; env CONFIG qwen3_6_35b_a3b for the MoE model)
#   mtpphases [MODE] [TREE]  issue 20: the 27B MTP step (c=1, osl 256, MODE rejected by
#                       default) phase by phase per window of 32 steps
#                       (benchmarks/spec_step_phases.py), for the tree at TREE (default .)
#   t1prof              issue 19: one turn-1 wave (27B, c=32) profiled with reuse on, then off
#                       (TRTLLM_BENCH_PROFILE: op tables, device idle and busy timeline)
#   b27 [CONC...]       issue 20: Qwen3.6-27B bf16 at the issue's command (osl 256; default
#                       c=1 32 64), the engine in its own process
#   gdn                 one 27B DeltaNet layer: decode step, recurrence, verify rows, conv
#   a3b [QUANT]         issues 16/20: Qwen3.6-35B-A3B at c=1/32/128, osl 256 (QUANT: fp8_block,
#                       the default, or none for bf16), FP8 KV cache; the engine in its own
#                       process (the default: in process, the bench's image preprocessing
#                       shares the GIL with the engine loop and the c=128 wave varies 10-15%)
#   a3bserved [QUANT]   the same model through a trtllm-serve child (the figure users see),
#                       c=32/128 (env CONC), osl 256 (env OSL), FP8 KV cache; env EXTRA adds
#                       bench flags (e.g. "--mamba_ssm_cache_dtype bfloat16")
#   srv8 [N...]         Qwen3-VL-8B fp8 through trtllm-serve at c=128, osl 1000, once per
#                       --stream_interval N (default 1 4): throughput, ITL and server_cpu_pct
#   a3bprof [QUANT]     one c=128 prefill wave of 35B-A3B (osl 8) under TRTLLM_BENCH_PROFILE
#                       (op tables, device busy timeline, one timeline line per request)
#   fresh32 [CONFIG]    issue 20: the same c=32 wave (osl 64) in two fresh processes, TTFT p50
#                       of each and their ratio (CONFIG: qwen3_6_35b_a3b, the default, or 27b)
#   blk8                issue 16: Qwen3-VL-8B fp8_block at c=32/128, GEMM choice auto, then
#                       TRTLLM_FP8_BLOCK_GEMM=cublas (cuBLASLt from 16 rows)
#   blk8tree [TREE]     issue 16: Qwen3-VL-8B fp8_block at c=1/32/128 (GEMM choice auto, in
#                       process) for the tree at TREE (default .): the A/B of a block-GEMM change
#   tunedec             issue 16: tune_fp8_block.py at 1-64 rows over Qwen3-VL-8B's projections
#   moe                 bench_moe.py at 1-128 tokens, with the router GEMM 257 vs 264 columns
#   moefp8              bench_moe.py's block-FP8 grouped GEMM tiles at 1024-8192 prefill tokens
#   dec35               issues 16/20: the 35B-A3B decode kernels at 32/128 rows: the DeltaNet
#                       recurrence over BLOCK_V x warps (float32 and bf16 state), the block-FP8
#                       grouped GEMM tiles at 32/128/256 tokens (bench_moe.py)
#   dec35step [TREE]    the 35B-A3B 128-row decode step (fp8_block, FP8 KV): graph replay time
#                       and its top kernels (profile_decode.py), for the tree at TREE
#   prefillk [TREE]     the prefill kernels of the 35B-A3B wave for the tree at TREE (default .):
#                       the varlen conv's tiles (bench_gdn.py, carried and fresh waves) and the
#                       block-FP8 MoE tiles at 4096 / 8192 tokens (bench_moe.py); an A/B runs it
#                       for `git archive BASE | tar -x -C ab_base` and for .
#
# Wheels: run ../shared/tools/gpu-wheels.sh here first and pass carry [".whl"].
# NOTE: `timeout` runs programs, not shell functions: every step calls python3 directly.
set -o pipefail
STAGE=${1:?stage}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH=/tmp/site:$PWD

# Progress bars redrawn with \r would fill the tail that comes back: keep their last line.
quiet() { tr '\r' '\n' | grep -v -E 'it/s\]|s/it\]|incorrect regex pattern'; }

GPU_FILES=$(grep -rl "mark.gpu" tests | sort)
THIRD=$(( ($(echo "$GPU_FILES" | wc -l) + 2) / 3 ))

case "$STAGE" in
tests-a | tests-b | tests-c)
    part=$(( $(printf '%d' "'${STAGE#tests-}") - 97 ))  # a, b, c -> 0, 1, 2
    files=$(echo "$GPU_FILES" | tail -n +"$((part * THIRD + 1))" | head -n "$THIRD")
    # SIGABRT: faulthandler prints every thread's stack if the limit cuts a hang.
    timeout -s ABRT 500 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
        $files 2>&1 | quiet > "$OUT/$STAGE.log"
    # The progress lines, the failures and the summary (a cut run: the test it was in).
    grep -E '^[.FEsx]+ |^(FAILED|ERROR)|passed|failed|File "/.*/tests/' "$OUT/$STAGE.log" \
        | tail -40
    ;;
mtpwarm)
    # The full log stays in $OUT; the tail shows the assertion's distinct step errors.
    timeout -s ABRT 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
        tests/unittest/_torch/pyexecutor/test_warmup_gpu.py -k mtp 2>&1 | quiet \
        > "$OUT/mtpwarm.log"
    grep -E "^E |passed|failed" "$OUT/mtpwarm.log" | cut -c1-400 | head -40
    ;;
std)
    tree=${2:-.}
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout -s ABRT 280 python3 -m \
        tensorrt_llm.commands.bench --config benchmarks/configs/qwen3_vl_8b.json --isl 1000 \
        --osl 1000 --image_size 512 --concurrency 1 32 128 --quantization fp8 \
        --kv_cache_dtype fp8 --output "$OUT/std_$(basename "$(realpath "$tree")").json") 2>&1 \
        | quiet | tail -20 | tee "$OUT/std.log"
    ;;
mt27 | mt8)
    config=qwen3_6_27b
    [ "$STAGE" = mt8 ] && config=qwen3_vl_8b
    for reuse in --enable_block_reuse --no-enable_block_reuse; do
        timeout -s ABRT 280 python3 -m tensorrt_llm.commands.bench \
            --config "benchmarks/configs/$config.json" --image_size 512 --executor_mode inproc \
            --isl 1000 --osl 50 --multi_turn 4 --turn_tokens 800 --concurrency 32 $reuse \
            --output "$OUT/$STAGE${reuse#--}.json" 2>&1 | quiet | tee "$OUT/$STAGE${reuse#--}.full.log" \
            | tail -20 | tee -a "$OUT/$STAGE.log"
    done
    ;;
mtp27 | mtp27c32)
    spec='{"decoding_type":"MTP","num_nextn_predict_layers":3}'
    conc=1
    [ "$STAGE" = mtp27c32 ] && conc=32
    tree=${2:-.}
    name=$(basename "$(realpath "$tree")")
    for mode in ${MODES:-oracle rejected}; do
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout -s ABRT 250 python3 -m \
            tensorrt_llm.commands.bench --config benchmarks/configs/qwen3_6_27b.json --isl 1000 \
            --osl "${OSL:-256}" --image_size 512 --concurrency "$conc" --executor_mode inproc \
            --no-enable_block_reuse --speculative_config "$spec" --draft_mode "$mode" \
            --output "$OUT/${STAGE}_${mode}_$name.json") 2>&1 | quiet | tail -${TAIL:-40} \
            | sed "s|^|$name $mode |" | tee -a "$OUT/$STAGE.log"
    done
    ;;
mtpgraphs)
    # The MTP step's CUDA graphs, one process each, as digits verify / draft / rollback
    # graphs: 000 none (the verify step as chunks, as before 7d249bf), 100 the verify graphs,
    # 110 verify and draft graphs (the default), 111 all three; env GRAPHS picks ("110 111"),
    # "nospec" runs without speculation (the ITL the bounds compare with). Env CONFIG:
    # qwen3_6_27b (the default) or qwen3_6_35b_a3b.
    config=benchmarks/configs/${CONFIG:-qwen3_6_27b}.json
    for graphs in ${GRAPHS:-000 100 110 111}; do
        set -- "${graphs:0:1}" "${graphs:1:1}" "${graphs:2:1}"
        spec=(--speculative_config '{"decoding_type":"MTP","num_nextn_predict_layers":3}'
            --draft_mode "${MODE:-rejected}")
        [ "$graphs" = nospec ] && spec=() && set -- 1 1 0
        TRTLLM_MTP_VERIFY_GRAPHS=$1 TRTLLM_MTP_DRAFT_GRAPHS=$2 TRTLLM_MTP_ROLLBACK_GRAPHS=${3:-0} \
            timeout -s ABRT 180 python3 -m tensorrt_llm.commands.bench --config "$config" \
            --isl 1000 --osl "${OSL:-256}" --image_size 512 --concurrency "${CONC:-1}" \
            --executor_mode inproc --no-enable_block_reuse "${spec[@]}" \
            --output "$OUT/mtpgraphs_${CONFIG:-qwen3_6_27b}_${graphs}_${MODE:-rejected}.json" 2>&1 | quiet | tail -6 \
            | sed "s|^|graphs=$graphs |" | tee -a "$OUT/mtpgraphs.log"
    done
    ;;
mtpphases)
    spec='{"decoding_type":"MTP","num_nextn_predict_layers":3}'
    tree=${3:-.}
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout -s ABRT 250 python3 \
        benchmarks/spec_step_phases.py --window 32 -- \
        --config benchmarks/configs/qwen3_6_27b.json --isl 1000 --osl 256 --image_size 512 \
        --concurrency 1 --executor_mode inproc --no-enable_block_reuse \
        --speculative_config "$spec" --draft_mode "${2:-rejected}") 2>&1 | quiet | tail -32 \
        | sed "s|^|$(basename "$(realpath "$tree")") |" | tee -a "$OUT/mtpphases.log"
    ;;
t1prof)
    for reuse in enable no-enable; do
        TRTLLM_BENCH_PROFILE="$OUT/t1prof_$reuse.txt" timeout -s ABRT 200 python3 -m \
            tensorrt_llm.commands.bench --config benchmarks/configs/qwen3_6_27b.json \
            --isl 1000 --image_size 512 --executor_mode inproc --osl 8 --concurrency 32 \
            --"${reuse}"_block_reuse 2>&1 | quiet | tail -4 | tee -a "$OUT/t1prof.log"
        grep -A1 "^device:" "$OUT/t1prof_$reuse.txt" | tee -a "$OUT/t1prof.log"
    done
    ;;
b27)
    shift
    timeout -s ABRT 420 python3 -m tensorrt_llm.commands.bench \
        --config benchmarks/configs/qwen3_6_27b.json --isl 1000 --osl 256 --image_size 512 \
        --concurrency ${*:-1 32 64} --output "$OUT/b27.json" 2>&1 | quiet | tail -20 \
        | tee -a "$OUT/b27.log"
    ;;
gdn)
    timeout -s ABRT 200 python3 benchmarks/bench_gdn.py --config benchmarks/configs/qwen3_6_27b.json \
        --batches 1,8,32 2>&1 | quiet | tail -30 | tee "$OUT/gdn.log"
    ;;
a3b)
    quant=${2:-fp8_block}
    qflag=(--quantization "$quant")
    [ "$quant" = none ] && qflag=()
    timeout -s ABRT 400 python3 -m tensorrt_llm.commands.bench \
        --config benchmarks/configs/qwen3_6_35b_a3b.json --isl 1000 --osl 256 --image_size 512 \
        --concurrency 1 32 128 --kv_cache_dtype fp8 "${qflag[@]}" \
        --output "$OUT/a3b_$quant.json" 2>&1 | quiet | tail -20 | tee -a "$OUT/a3b.log"
    ;;
a3bserved)
    quant=${2:-fp8_block}
    qflag=(--quantization "$quant")
    [ "$quant" = none ] && qflag=()
    timeout -s ABRT 420 python3 -m tensorrt_llm.commands.bench --served \
        --config benchmarks/configs/qwen3_6_35b_a3b.json --isl 1000 --osl "${OSL:-256}" \
        --image_size 512 --concurrency ${CONC:-32 128} --kv_cache_dtype fp8 "${qflag[@]}" \
        ${EXTRA:-} --output "$OUT/a3bserved_${quant}_osl${OSL:-256}.json" 2>&1 | quiet | tail -12 \
        | tee -a "$OUT/a3bserved.log"
    ;;
srv8)
    shift
    for n in "${@:-1}" $([ $# -eq 0 ] && echo 4); do
        timeout -s ABRT 280 python3 -m tensorrt_llm.commands.bench --served \
            --config benchmarks/configs/qwen3_vl_8b.json --isl 1000 --osl 1000 --image_size 512 \
            --concurrency 128 --quantization fp8 --kv_cache_dtype fp8 --stream_interval "$n" \
            --output "$OUT/srv8_si$n.json" 2>&1 | quiet | tail -4 | sed "s/^/si=$n /" \
            | tee -a "$OUT/srv8.log"
    done
    ;;
a3bprof)
    quant=${2:-fp8_block}
    qflag=(--quantization "$quant")
    [ "$quant" = none ] && qflag=()
    TRTLLM_BENCH_PROFILE="$OUT/a3bprof_$quant.txt" timeout -s ABRT 250 python3 -m \
        tensorrt_llm.commands.bench --config benchmarks/configs/qwen3_6_35b_a3b.json \
        --isl 1000 --image_size 512 --executor_mode inproc --osl 8 --concurrency 128 \
        --kv_cache_dtype fp8 "${qflag[@]}" 2>&1 | quiet | tail -4 | tee -a "$OUT/a3bprof.log"
    head -45 "$OUT/a3bprof_$quant.txt" | cut -c1-90,170-260 | tee -a "$OUT/a3bprof.log"
    grep -A1 "^device:" "$OUT/a3bprof_$quant.txt" | tee -a "$OUT/a3bprof.log"
    ;;
fresh32)
    config=benchmarks/configs/${2:-qwen3_6_35b_a3b}.json
    [ -f "$config" ] || config=benchmarks/configs/qwen3_6_${2}.json
    for run in 1 2; do
        timeout -s ABRT 250 python3 -m tensorrt_llm.commands.bench --config "$config" \
            --isl 1000 --osl 64 --image_size 512 --concurrency 32 \
            --output "$OUT/fresh32_$run.json" 2>&1 | quiet | tail -2 | tee -a "$OUT/fresh32.log"
    done
    python3 - "$OUT" <<'PY' | tee -a "$OUT/fresh32.log"
import json, sys
rows = [json.load(open(f"{sys.argv[1]}/fresh32_{i}.json"))["ours"][0] for i in (1, 2)]
t = [r["ttft_ms_p50"] for r in rows]
print(f"TTFT p50 {t[0]:.1f} / {t[1]:.1f} ms: ratio {max(t) / min(t):.2f} (target <= 1.3)")
PY
    ;;
blk8)
    for gemm in auto cublas; do
        TRTLLM_FP8_BLOCK_GEMM=$gemm timeout -s ABRT 280 python3 -m tensorrt_llm.commands.bench \
            --config benchmarks/configs/qwen3_vl_8b.json --isl 1000 --osl 1000 --image_size 512 \
            --concurrency 32 128 --quantization fp8_block --kv_cache_dtype fp8 \
            --executor_mode inproc --output "$OUT/blk8_$gemm.json" 2>&1 | quiet | tail -4 \
            | sed "s/^/$gemm /" | tee -a "$OUT/blk8.log"
    done
    ;;
blk8tree)
    tree=${2:-.}
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout -s ABRT 280 python3 -m \
        tensorrt_llm.commands.bench --config benchmarks/configs/qwen3_vl_8b.json --isl 1000 \
        --osl 1000 --image_size 512 --concurrency 1 32 128 --quantization fp8_block \
        --kv_cache_dtype fp8 --executor_mode inproc \
        --output "$OUT/blk8_$(basename "$(realpath "$tree")").json") 2>&1 | quiet | tail -5 \
        | sed "s|^|$(basename "$(realpath "$tree")") |" | tee -a "$OUT/blk8tree.log"
    ;;
tunedec)
    timeout -s ABRT 250 python3 benchmarks/tune_fp8_block.py --rows 1 16 32 64 --shapes 8b.qkv \
        8b.o 8b.gate_up 8b.down --output "$OUT/tunedec.json" 2>&1 | quiet \
        | grep -E "best|M  *[0-9]+ |Error" | tee "$OUT/tunedec.log"
    ;;
moe)
    timeout -s ABRT 250 python3 benchmarks/bench_moe.py --tokens 1 16 64 128 \
        --output "$OUT/moe.json" 2>&1 | quiet | grep -E "===|best|align|routing|router|layer" \
        | tee "$OUT/moe.log"
    ;;
moefp8)
    timeout -s ABRT 280 python3 benchmarks/bench_moe.py --tokens --router_tokens \
        --prefill_fp8_tokens 1024 4096 8192 --output "$OUT/moefp8.json" 2>&1 | quiet \
        | tee "$OUT/moefp8.log"
    ;;
dec35)
    timeout -s ABRT 150 python3 benchmarks/bench_gdn.py \
        --config benchmarks/configs/qwen3_6_35b_a3b.json --batches 32,128 --iters 50 2>&1 \
        | grep -E "decode|Error" | tee "$OUT/dec35.log"
    timeout -s ABRT 200 python3 benchmarks/bench_moe.py --tokens --router_tokens \
        --fp8_block_tokens 32 128 256 --output "$OUT/dec35_moe.json" 2>&1 | quiet \
        | tee -a "$OUT/dec35.log" | grep -E "===|table's|Error|  (gate_up|down)" | head -80
    ;;
dec35step)
    tree=${2:-.}
    # PDL off: with it the profiler's kernel times include the wait for the predecessor.
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD TRTLLM_PDL=0 timeout -s ABRT 200 python3 \
        benchmarks/profile_decode.py --config benchmarks/configs/qwen3_6_35b_a3b.json \
        --batch 128 --steps 20 --quantization fp8_block --kv_cache_dtype fp8) 2>&1 | quiet \
        | grep -E "graph replay|kernel|Self CUDA|^ *_|nvjet|cutlass|reduce" | head -24 \
        | sed "s|^|$(basename "$(realpath "$tree")") |" | tee -a "$OUT/dec35step.log"
    ;;
prefillk)
    tree=${2:-.}
    (cd "$tree" && export PYTHONPATH=/tmp/site:$PWD && timeout -s ABRT 90 python3 \
        benchmarks/bench_gdn.py --config benchmarks/configs/qwen3_6_35b_a3b.json --batches 1 \
        --iters 30 2>&1 | grep -E "prefill_conv1d|Error"; timeout -s ABRT 150 python3 \
        benchmarks/bench_moe.py --tokens --router_tokens --prefill_fp8_tokens 4096 8192 2>&1 \
        | grep -E "===|table's|Error") | sed "s|^|$(basename "$(realpath "$tree")") |" \
        | tee -a "$OUT/prefillk.log"
    ;;
*)
    echo "unknown stage $STAGE" >&2
    exit 2
    ;;
esac
