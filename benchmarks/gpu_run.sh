#!/usr/bin/env bash
# One GPU session, run from the repo root on the GPU machine (carry .whl for fla-core + einops):
#   MODE=parity  kernel parity at GPU shapes, one process per job in parallel ($OUT/parity.txt);
#                IMPLS=mosaic: fla_jax's Mosaic GPU kernels against float64 and fla_torch's Triton;
#                DTYPES="bf16 fp16": only those; OVERRIDE="<module>:NAME=value" (an opt-in
#                kernel, benchmarks/with_override.py)
#   MODE=bench   the benchmark steps below (STEPS, default all), one process after another
#                ($OUT/bench.txt, bench.md, bench.json)
#   MODE=profile device time per kernel (benchmarks/kernel_profile.py) of PROFILE_OPS on
#                PROFILE_PATHS, bf16, at each op's benchmark shape ($OUT/profile.txt, .json)
#   MODE=regress this tree against a base revision in the same call (issue 10's no-regression
#                bar): BASE_TREE is the base's files, exported beforehand (and carried):
#                  git archive 521de5e | tar -x -C scratch/base   (521de5e: before the engine)
#                per op of REGRESS_OPS, the base's run.py then ours (REGRESS_DTYPES, B4T4096,
#                triton + pallas), then benchmarks/regress.py ($OUT/regress.md)
# FLA_AUTOTUNE=<tgz of *.autotune.json> reuses FLA's autotune results from an earlier run
# (Triton's TRITON_CACHE_AUTOTUNING); FLA's cold first calls are then measured separately.
# benchmarks/cache/fla_autotune_gla_h100.tgz: FLA 0.6.0's chunk_gla kernels, H100, Triton 3.6.0
# (RESULTS.md run 14 call 2; its cold first call took 221 s).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${WHEELS_DONE:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then   # gpu_split.sh installs once
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:.
fi
export PYTHONPATH=${PYTHONPATH:-.}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
MODE=${MODE:-parity}
if [ "$MODE" = parity ]; then
  # one process per job "op[:case,case,...]" (no cases: every GPU case); the slow ops are
  # split by case so that every job ends within PARITY_S. Longest first (job times of RESULTS
  # run 13, 12 at once on an H200: the chunk delta / KDA / RWKV-7 jobs 240-330 s, GLA / GSA /
  # attention ~100-200, the fused_recurrent ones 30-70): in the order they were listed there,
  # chunk_gsa started last and the call's limit cut it
  G1=gpu_4k,gpu_gqa,gpu_varlen; G2=gpu_d100,gpu_strong_edges,gpu_strong_uniform,gpu_t16k
  JOBS=${JOBS:-"chunk_gated_delta_rule:gpu_varlen,gpu_d100,gpu_strong_uniform
    chunk_delta_rule:$G1 chunk_delta_rule:$G2 chunk_kda:$G1 chunk_rwkv7:$G2
    chunk_gated_delta_rule:gpu_4k,gpu_gqa chunk_kda:$G2 chunk_simple_gla
    chunk_gated_delta_rule:gpu_strong_edges,gpu_t16k chunk_rwkv7:$G1 chunk_gsa:$G1 chunk_gsa:$G2
    chunk_gla:$G2 attention chunk_gla:$G1 fused_recurrent_gsa fused_recurrent_kda:$G1
    fused_recurrent_kda:$G2 fused_recurrent_rwkv7:$G1 fused_recurrent_rwkv7:$G2
    fused_recurrent_simple_gla:$G1 fused_recurrent_simple_gla:$G2 fused_recurrent_delta_rule:$G1
    fused_recurrent_delta_rule:$G2 fused_recurrent_gated_delta_rule:$G1
    fused_recurrent_gated_delta_rule:$G2 fused_recurrent_gla:$G1 fused_recurrent_gla:$G2"}
  i=0
  for job in $JOBS; do
    op=${job%%:*}; cases=""; [ "$op" != "$job" ] && cases=${job#*:}
    i=$((i + 1))
    impls=${IMPLS:-kernel}; [ "$op" = attention ] && impls=default   # attention: engines, no kernel
    # OVERRIDE="<module>:NAME=value": module constants set for the run (with_override.py)
    timeout ${PARITY_S:-480} python3 ${OVERRIDE:+benchmarks/with_override.py "$OVERRIDE"} \
      -m parity_tests --device cuda --impls $impls --ops $op \
      ${DTYPES:+--dtypes $DTYPES} \
      ${cases:+--cases ${cases//,/ }} > "$OUT/p_$(printf %02d $i)_$op.log" 2>&1 &
    # at most PAR jobs at once: 23 at once ran the one GPU out of memory (DPLR chunk jobs)
    while [ "$(jobs -r | wc -l)" -ge "${PAR:-12}" ]; do sleep 2; done
  done
  wait
  cat "$OUT"/p_*.log > "$OUT/parity.txt"; rm -f "$OUT"/p_*.log
  grep -E "FAIL|Error" "$OUT/parity.txt" | cut -c1-230 | head -40
  grep -E "comparisons" "$OUT/parity.txt"
  exit 0
fi
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
if [ -n "${FLA_AUTOTUNE:-}" ]; then mkdir -p "$TRITON_CACHE_DIR" && tar xzf "$FLA_AUTOTUNE" -C "$TRITON_CACHE_DIR"; fi
if [ "$MODE" = regress ]; then
  BASE_TREE=$(cd "${BASE_TREE:-scratch/base}" && pwd) || exit 1
  mkdir -p "$OUT/base" "$OUT/new"
  for op in ${REGRESS_OPS:-simple_gla delta_rule gated_delta_rule}; do
    for side in base new; do
      dir=$PWD; [ $side = base ] && dir=$BASE_TREE
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout ${BENCH_S:-300} python3 benchmarks/run.py \
        --ops $op --dtypes ${REGRESS_DTYPES:-bf16 fp16 fp32} --shapes B4T4096 \
        --paths triton pallas --json "$OUT/$side/$op.json" 2>&1 | grep -E "ms,|FAILED" \
        | sed "s/^/[$side] /" | tee -a "$OUT/regress.txt")
    done
  done
  python3 benchmarks/regress.py "$OUT/base" "$OUT/new" | tee "$OUT/regress.md"
  exit 0
fi
if [ "$MODE" = profile ]; then
  timeout ${PROFILE_S:-400} python3 benchmarks/kernel_profile.py --ops ${PROFILE_OPS:-kda rwkv7 gla} \
    --paths ${PROFILE_PATHS:-triton fla pallas} --json "$OUT/profile.json" 2>&1 \
    | grep -v -E "Warning|USDT" | tee "$OUT/profile.txt" | grep -E "^== "
  exit 0
fi
BJ=$OUT/bj; mkdir -p "$BJ"   # JSON per step under $OUT: kept even when a later step times out
b() { timeout ${BENCH_S:-300} python3 benchmarks/run.py --json $BJ/$1.json "${@:2}" 2>&1 \
        | grep -v Warning | tee -a "$OUT/bench.txt" | grep -E "FAILED|ms,"; }
A="--ops simple_gla gla delta_rule gated_delta_rule"
D="--ops delta_rule gated_delta_rule"
for step in ${STEPS:-1 2 3 4 5 6 10}; do
  case $step in
    1) b 1 $A --dtypes bf16 --shapes B4T4096 --paths fla triton pallas ;;
    2) b 2 $A --dtypes fp16 fp32 --shapes B4T4096 --paths triton pallas ;;
    3) b 3 --ops simple_gla --dtypes bf16 --shapes B4T4096 --paths torch-chunked jax-chunked sdpa ;;
    4) b 4 $A --dtypes bf16 --shapes B1T32768 --paths triton pallas ;;
    5) b 5 --ops gated_delta_rule --dtypes bf16 --shapes GQA_H8HV16 --paths fla triton pallas ;;
    6) b 6 $D --dtypes fp16 fp32 --shapes B4T4096 --paths fla ;;
    7) b 7 --ops simple_gla --dtypes bf16 --shapes B4T4096 --paths fla triton ;;
    8) b 8 --ops gla --dtypes bf16 --shapes B4T4096 --paths fla triton pallas torch-chunked jax-chunked ;;
    9) b 9 --ops gla --dtypes fp16 fp32 --shapes B4T4096 --paths triton pallas ;;
    10) b 10 --ops attention --dtypes bf16 ;;   # ours vs SDPA flash / jax cuDNN (issue 13)
    # issues 12 and 14: the new families against FLA and jax-linear-attention, same call
    11) b 11 --ops kda rwkv7 gsa --dtypes bf16 --shapes B4T4096 B4T4096K64 GSA_H4M64 \
          --paths fla jla triton pallas ;;
    12) b 12 --ops kda rwkv7 gsa --dtypes fp16 fp32 --shapes B4T4096 B4T4096K64 GSA_H4M64 \
          --paths triton pallas ;;
    # issue 11: jax-linear-attention's Mosaic GPU kernels for the existing families
    13) b 13 --ops simple_gla gla delta_rule gated_delta_rule --dtypes bf16 --shapes B4T4096 \
          --paths jla pallas ;;
    # issue 10's GLA bar alone (ours vs FLA and jla, same call): STEPS="15 14" with the sweep
    15) b 15 --ops gla --dtypes bf16 --shapes B4T4096 --paths fla jla triton pallas ;;
    # issue 11: the Mosaic delta family against jla and the Pallas kernels (issue 11's shapes),
    # then the Mosaic ops with the Pallas backward behind them (mosaic_chunk.BACKWARD) in the
    # same process
    16) b 16 --ops gated_delta_rule delta_rule --dtypes bf16 --shapes B4T4096 \
          --paths jla mosaic pallas
        b 16f --ops gated_delta_rule delta_rule --dtypes fp16 --shapes B4T4096 --paths mosaic
        b 16l --ops gated_delta_rule --dtypes bf16 --shapes B1T32768 GQA_H8HV16 \
          --paths jla mosaic
        for op in gated_delta_rule delta_rule; do
          timeout ${BENCH_S:-300} python3 benchmarks/pallas_launch_sweep.py --op $op \
            --impl mosaic --dtype bf16 \
            --variant "fla_jax.ops.gated_delta_rule.mosaic_chunk:BACKWARD=pallas" \
            2>&1 | grep -v Warning | tee -a "$OUT/bench.txt"
        done ;;
    # issue 11: simple GLA's opt-in Mosaic backward against the Pallas one and jla; the
    # Mosaic GDN forward with its products issued one at a time (OVERLAP=0: fewer live
    # accumulators; the kernel spills 324 B at 255 registers) and ptxas' counts for it
    17) b 17 --ops simple_gla --dtypes bf16 --shapes B4T4096 --paths jla mosaic
        timeout ${BENCH_S:-300} python3 benchmarks/pallas_launch_sweep.py --op simple_gla \
          --impl mosaic --dtype bf16 \
          --variant "fla_jax.ops.simple_gla.mosaic_chunk:BACKWARD=mosaic" \
          2>&1 | grep -v Warning | tee -a "$OUT/bench.txt"
        F=fla_jax.ops.gated_delta_rule.mosaic_fwd_kernel:OVERLAP=0
        timeout ${BENCH_S:-300} python3 benchmarks/pallas_launch_sweep.py --op gated_delta_rule \
          --impl mosaic --dtype bf16 --variant "$F" 2>&1 | grep -v Warning | tee -a "$OUT/bench.txt"
        timeout ${BENCH_S:-300} python3 benchmarks/mosaic_ptxas.py --op gated_delta_rule \
          --variant "$F" 2>&1 | grep -v Warning | tee -a "$OUT/bench.txt" ;;
    # issue 11: the delta family's gradient kernel on two warpgroups (mosaic_bwd_grads_ws.py,
    # opt-in) against one, and ptxas' counts for it; its parity: MODE=parity IMPLS=mosaic
    # OVERRIDE="fla_jax.ops.gated_delta_rule.mosaic_bwd_grads:WARPGROUPS=2"
    18) W=fla_jax.ops.gated_delta_rule.mosaic_bwd_grads:WARPGROUPS=2
        for op in gated_delta_rule delta_rule; do
          timeout ${BENCH_S:-300} python3 benchmarks/pallas_launch_sweep.py --op $op \
            --impl mosaic --dtype bf16 --variant "$W" 2>&1 | grep -v Warning | tee -a "$OUT/bench.txt"
        done
        timeout ${BENCH_S:-300} python3 benchmarks/mosaic_ptxas.py --op gated_delta_rule \
          --variant "$W" 2>&1 | grep -v Warning | tee -a "$OUT/bench.txt" ;;
    # issue 11: the T0 kernel with several chunks per CTA (mosaic_kkt.CHUNKS_PER_CTA, opt-in:
    # double-buffered loads, asynchronous stores; 198 us vs jla's 50 with one chunk, RESULTS
    # run 16) on the whole op, and ptxas' counts; its parity: MODE=parity IMPLS=mosaic
    # OVERRIDE="fla_jax.ops.gated_delta_rule.mosaic_kkt:CHUNKS_PER_CTA=8"
    19) T=fla_jax.ops.gated_delta_rule.mosaic_kkt:CHUNKS_PER_CTA
        timeout ${BENCH_S:-300} python3 benchmarks/pallas_launch_sweep.py --op gated_delta_rule \
          --impl mosaic --dtype bf16 --variant "$T=2" --variant "$T=4" --variant "$T=8" \
          --variant "$T=16" 2>&1 | grep -v Warning | tee -a "$OUT/bench.txt"
        timeout ${BENCH_S:-300} python3 benchmarks/mosaic_ptxas.py --op gated_delta_rule \
          --variant "$T=8" 2>&1 | grep -v Warning | tee -a "$OUT/bench.txt" ;;
    # issue 11: GLA's Mosaic forward (mosaic_intra_kernel.py + mosaic_fwd_kernel.py; its
    # training step runs the Pallas kernels) against jla and the Pallas forward; its parity:
    # MODE=parity IMPLS=mosaic JOBS="chunk_gla:gpu_4k,gpu_gqa,gpu_varlen
    # chunk_gla:gpu_strong_edges,gpu_strong_uniform,gpu_t16k" (RESULTS.md run 17)
    20) b 20 --ops gla --dtypes bf16 --shapes B4T4096 --paths jla mosaic pallas
        b 20f --ops gla --dtypes fp16 --shapes B4T4096 --paths mosaic ;;
    # issue 11: GLA's opt-in Mosaic backward (mosaic_bwd.py, mosaic_chunk.BACKWARD=mosaic;
    # interpreted and lowered only) against the Pallas one behind the Mosaic forward and jla;
    # its parity: MODE=parity IMPLS=mosaic OVERRIDE="fla_jax.ops.gla.mosaic_chunk:BACKWARD=mosaic"
    # JOBS="chunk_gla:gpu_4k,gpu_gqa,gpu_varlen chunk_gla:gpu_strong_edges,gpu_strong_uniform,gpu_t16k"
    21) b 21 --ops gla --dtypes bf16 --shapes B4T4096 --paths jla mosaic
        timeout ${BENCH_S:-300} python3 benchmarks/pallas_launch_sweep.py --op gla --impl mosaic \
          --dtype bf16 --variant "fla_jax.ops.gla.mosaic_chunk:BACKWARD=mosaic" 2>&1 \
          | grep -v Warning | tee -a "$OUT/bench.txt" ;;
    # issue 11: the T0 kernel's merges (mosaic_kkt.MERGE: "fp16" the default since run 24 in
    # both dtypes, "hilo" exact) kernel-only in bf16 and fp16 (against jla in bf16), its
    # accuracy on the GPU, the fp16 bar (fp16 within 1.05x of bf16) on the whole op, and GLA's
    # sequence split (gla.mosaic_split.SPLIT, the default since run 23) at B1 T32768 against
    # jla. Parity of a merge: MODE=parity IMPLS=mosaic OVERRIDE="<kkt>:MERGE=hilo"
    # JOBS="chunk_gated_delta_rule:gpu_4k,gpu_strong_uniform chunk_delta_rule:gpu_4k"
    22) KKT=fla_jax.ops.gated_delta_rule.mosaic_kkt
        for dt in bf16 fp16; do
          # several chunks per CTA under the 16-block solve (1 was best under hilo-32, run 20)
          timeout ${BENCH_S:-300} python3 benchmarks/mosaic_kernel_time.py --dtype $dt \
            $([ $dt = fp16 ] && echo --no-jla) --variant "$KKT:MERGE=hilo" \
            --variant "$KKT:CHUNKS_PER_CTA=2" --variant "$KKT:CHUNKS_PER_CTA=4" 2>&1 \
            | grep -v Warning | tee -a "$OUT/bench.txt"
        done
        timeout ${BENCH_S:-300} python3 benchmarks/mosaic_t0_check.py 2>&1 | grep -v Warning \
          | tee -a "$OUT/bench.txt"
        b 22a --ops gated_delta_rule delta_rule --dtypes bf16 fp16 --shapes B4T4096 --paths mosaic
        b 22 --ops gla --dtypes bf16 --shapes B1T32768 --paths jla mosaic ;;
    # issue 11 on the H200 (RESULTS.md run 25): simple GLA's forward at B4 T4096 is 1.11x jla
    # (1.00x on the H100): the split into sequence pieces at 128 CTAs too (P = 2 / 4: its
    # policy splits only at <= 64 CTAs), then where the time goes against jla
    23) SP=fla_jax.ops.simple_gla.mosaic_split:POLICY
        timeout ${BENCH_S:-300} python3 benchmarks/pallas_launch_sweep.py --op simple_gla \
          --impl mosaic --dtype bf16 --variant "$SP.max_ctas=128" \
          --variant "$SP.max_ctas=128,POLICY.target_ctas=528" 2>&1 | grep -v Warning \
          | tee -a "$OUT/bench.txt"
        timeout ${BENCH_S:-300} python3 benchmarks/kernel_profile.py --ops simple_gla \
          --paths mosaic jla 2>&1 | grep -v -E "Warning|USDT" | tee -a "$OUT/bench.txt" ;;
    # issue 11 (RESULTS.md run 27): the rows whose jla half the time limits cut (GQA GDN,
    # simple GLA B1 T32768), then where the first calls that miss 20 s go (GQA GDN 21.7 s,
    # the delta family at T32768 31-35 s: ~2.4 s of backend compile per Mosaic kernel)
    24) b 24a --ops gated_delta_rule --dtypes bf16 --shapes GQA_H8HV16 --paths mosaic jla
        b 24b --ops simple_gla --dtypes bf16 --shapes B1T32768 --paths mosaic jla
        for shape in GQA_H8HV16 B1T32768; do
          timeout ${BENCH_S:-300} python3 benchmarks/compile_time.py --op gated_delta_rule \
            --shape $shape --path mosaic 2>&1 | grep -v Warning | tee -a "$OUT/bench.txt"
        done ;;
    # issue 11 (RESULTS.md run 28): the delta family's B4 T4096 forward (device busy 174 vs
    # jla 167 us; XLA glue 4 kernels vs 3): mosaic_fwd_ws.LATER_IN_KERNEL (the ws forward's and
    # the map pass's update decay from G's columns, no G_last - G vector) by device time, then
    # rows ABBA with it. Its GPU parity first: MODE=parity IMPLS=mosaic DTYPES="bf16 fp16"
    # OVERRIDE="<LIK>=True" JOBS="<GDN / delta gpu_4k,gpu_varlen gpu_t16k (the split) ...>".
    25) LIK=fla_jax.ops.gated_delta_rule.mosaic_fwd_ws:LATER_IN_KERNEL
        for v in False True; do for shape in B4T4096 B1T32768; do
          timeout ${BENCH_S:-300} python3 benchmarks/with_override.py "$LIK=$v" \
            -m kernel_profile --ops gated_delta_rule delta_rule --paths mosaic --shape $shape \
            --top 8 2>&1 | grep -v -E "Warning|USDT" | tee -a "$OUT/bench.txt"
        done; done
        timeout ${BENCH_S:-300} python3 benchmarks/with_override.py "$LIK=True" -m run \
          --ops gated_delta_rule delta_rule --dtypes bf16 --shapes B4T4096 \
          --paths mosaic jla jla mosaic --json $BJ/25.json 2>&1 | grep -v Warning \
          | tee -a "$OUT/bench.txt" | grep -E "FAILED|ms," ;;
    # issue 11 (RESULTS.md run 29): first calls at B1 T32768 (delta rule 24.1 s; bar 20) with the
    # split's first reverse run by the storing kernel (mosaic_bwd.NOSTORE_RUN=storing: one Mosaic
    # compile fewer), then what its discarded stores cost (rows against jla). Its GPU parity
    # first: MODE=parity IMPLS=mosaic DTYPES="bf16 fp16" OVERRIDE="<NS>=storing"
    # JOBS="chunk_gated_delta_rule:gpu_t16k chunk_delta_rule:gpu_t16k,gpu_varlen"
    26) NS=fla_jax.ops.gated_delta_rule.mosaic_bwd:NOSTORE_RUN
        for v in nostore storing; do
          timeout ${BENCH_S:-300} python3 benchmarks/with_override.py "$NS=$v" -m compile_time \
            --op delta_rule --shape B1T32768 --path mosaic 2>&1 | grep -v Warning \
            | tee -a "$OUT/bench.txt"
        done
        timeout ${BENCH_S:-300} python3 benchmarks/with_override.py "$NS=storing" -m run \
          --ops delta_rule gated_delta_rule --dtypes bf16 --shapes B1T32768 \
          --paths mosaic jla --json $BJ/26.json 2>&1 | grep -v Warning \
          | tee -a "$OUT/bench.txt" | grep -E "FAILED|ms," ;;
    # issue 11 (RESULTS.md run 30): first calls with the kernels compiled ahead and lowered
    # once (common/mosaic/compile_ahead.py, lowering_cache.py), against both off, one process
    # each; then the rows with jla in the same call: the delta rule's B4 T4096 forward (1.00x
    # pooled in run 29) ABBA, and B1 T32768 first calls (ours first in a fresh process)
    27) M=fla_jax.ops.common.mosaic
        OFF="$M.compile_ahead:COMPILE_AHEAD=False;$M.lowering_cache:LOWERING_CACHE=False"
        for op in delta_rule gated_delta_rule; do for v in on off; do
          CMD=(benchmarks/compile_time.py)
          [ $v = off ] && CMD=(benchmarks/with_override.py "$OFF" -m compile_time)
          timeout ${BENCH_S:-300} python3 "${CMD[@]}" --op $op --shape B1T32768 --path mosaic \
            2>&1 | grep -v Warning | tee -a "$OUT/bench.txt" | grep -E "together|ahead"
        done; done
        b 27a --ops delta_rule --dtypes bf16 --shapes B4T4096 --paths mosaic jla jla mosaic
        b 27b --ops delta_rule --dtypes bf16 --shapes B1T32768 --paths mosaic jla
        b 27c --ops gated_delta_rule --dtypes bf16 --shapes B1T32768 --paths mosaic jla ;;
    # issue 11 (RESULTS.md run 30): the delta rule's forward by the ws kernel without decays
    # (g None: no gate vectors read, no decay products on the state chain); its device time
    # against jla's, then rows. Its GPU parity first: MODE=parity IMPLS=mosaic
    # DTYPES="bf16 fp16" JOBS="chunk_delta_rule:gpu_4k,gpu_varlen chunk_delta_rule:gpu_t16k,..."
    28) timeout ${BENCH_S:-300} python3 benchmarks/kernel_profile.py --ops delta_rule \
          --paths mosaic jla --shape B4T4096 --top 8 2>&1 | grep -v -E "Warning|USDT" \
          | tee -a "$OUT/bench.txt"
        b 28a --ops delta_rule --dtypes bf16 --shapes B4T4096 --paths mosaic jla jla mosaic
        b 28b --ops delta_rule --dtypes bf16 --shapes B1T32768 --paths mosaic jla ;;
    # issue 11 (RESULTS.md run 31): masks from row / column index vectors (tiles.iota: ~5% less
    # MLIR over the delta family's nine kernels). First calls in fresh processes, jla's in the
    # same call (step 30: rows of every Mosaic op against jla). Its GPU parity first (MODE=parity
    # IMPLS=mosaic DTYPES="bf16 fp16" over the four ops)
    29) for rep in 1 2; do for op in delta_rule gated_delta_rule; do
          timeout ${BENCH_S:-300} python3 benchmarks/compile_time.py --op $op --shape B1T32768 \
            --path mosaic 2>&1 | grep -v Warning | tee -a "$OUT/bench.txt" | grep -E "together"
        done; done
        for a in "gated_delta_rule GQA_H8HV16 mosaic" "simple_gla B1T32768 mosaic" \
                 "gla B1T32768 mosaic" "gated_delta_rule B1T32768 jla"; do set -- $a
          timeout ${BENCH_S:-300} python3 benchmarks/compile_time.py --op $1 --shape $2 \
            --path $3 2>&1 | grep -v Warning | tee -a "$OUT/bench.txt" | grep -E "together"
        done ;;
    30) b 30a --ops delta_rule gated_delta_rule --dtypes bf16 --shapes B4T4096 \
          --paths mosaic jla jla mosaic
        b 30b --ops delta_rule gated_delta_rule --dtypes bf16 --shapes B1T32768 --paths mosaic jla
        b 30c --ops simple_gla gla --dtypes bf16 --shapes B4T4096 --paths mosaic jla ;;
    # ... and the GQA row against jla, every Mosaic op in fp16 beside bf16 (the 1.05x bar)
    31) b 31a --ops gated_delta_rule --dtypes bf16 --shapes GQA_H8HV16 --paths mosaic jla
        b 31b $A --dtypes bf16 fp16 --shapes B4T4096 --paths mosaic ;;
    # ... 31's outliers again: device time per kernel (bf16 and fp16; the GQA row beside jla),
    # then rows in the other order (fp16 first; jla first)
    32) timeout ${BENCH_S:-300} python3 benchmarks/kernel_profile.py --ops simple_gla \
          --paths mosaic --dtypes bf16 fp16 --shape B4T4096 --top 6 2>&1 \
          | grep -v -E "Warning|USDT" | tee -a "$OUT/bench.txt"
        timeout ${BENCH_S:-300} python3 benchmarks/kernel_profile.py --ops gated_delta_rule \
          --paths mosaic jla --shape GQA_H8HV16 --top 6 2>&1 | grep -v -E "Warning|USDT" \
          | tee -a "$OUT/bench.txt"
        b 32a --ops simple_gla --dtypes fp16 bf16 --shapes B4T4096 --paths mosaic
        b 32b --ops gated_delta_rule --dtypes bf16 --shapes GQA_H8HV16 --paths jla mosaic mosaic jla ;;
    # issue 10: the GLA forward (1.08x FLA on the H200, run 13): cumsum_scores spills at the
    # shipped 4 warps / BK 32 (offline sm_90 compile: 255 registers, 408 B stack; 8 warps /
    # BK 16: 192, none), so time its launch variants on the whole op, defaults first.
    # STORE_CUM=0 is a probe, forward only: what writing the split cumsum (hi, lo fp32, 268 MB
    # here, twice FLA's saved gate cumsum) costs; its fwd+bwd reads unwritten memory
    14) CS=cumsum_scores._cumsum_scores_kernel
        timeout ${BENCH_S:-300} python3 benchmarks/launch_sweep.py --op gla --dtype bf16 \
          --variant "$CS:num_warps=8,BK=16" --variant "$CS:num_warps=8" \
          --variant "$CS:num_warps=4,BK=16" --variant "$CS:num_warps=8,BK=16,num_stages=1" \
          --variant "$CS:num_warps=4,maxnreg=128" --variant "$CS:num_warps=8,BK=64" \
          --variant "$CS:STORE_CUM=0" \
          2>&1 | grep -v Warning | tee -a "$OUT/bench.txt"
        # the Pallas twin (1.10x FLA forward on the H200): its cumsum_scores spills too at bk 64 /
        # 4 warps (benchmarks/offline_regs_pallas.py: 255 registers, 640 B; bk 32 / 8 warps: 219,
        # none; bk 16 / 8 warps: 183, none)
        timeout ${BENCH_S:-300} python3 benchmarks/pallas_launch_sweep.py --op gla --dtype bf16 \
          --variant "launch.cumsum_scores:bk=32,num_warps=8" \
          --variant "launch.cumsum_scores:bk=16,num_warps=8" \
          --variant "launch.cumsum_scores:bk=32" --variant "launch.cumsum_scores:num_warps=8" \
          --variant "launch.cumsum_scores:num_stages=3" --variant "cumsum_scores:DIAG=split" \
          --variant "launch.output_fwd:num_warps=8" --variant "launch.state_fwd:num_stages=3" \
          2>&1 | grep -v Warning | tee -a "$OUT/bench.txt" ;;
  esac
done
python3 benchmarks/merge.py $BJ/*.json > "$OUT/bench.md"
python3 - "$OUT/bench.json" $BJ/*.json <<'PY'
import json, sys
rows, env = [], None
for p in sys.argv[2:]:
    d = json.load(open(p)); env = env or d["env"]; rows += d["rows"]
json.dump({"env": env, "rows": rows}, open(sys.argv[1], "w"), indent=1)
PY
cat "$OUT/bench.md"
