#!/usr/bin/env bash
# Issue 10's GPU proof in ONE call on a machine of 4 GPUs (e.g. the device tool's nvidia-h100-x4),
# run from the repo root (carry .whl with fla-core, einops, jax-linear-attention, and the base tree):
#   GPU 3: MODE=parity of every kernel op (gpu_run.sh)
#   GPU 0: MODE=regress simple_gla delta_rule, GPU 1: MODE=regress gated_delta_rule
#          (BASE_TREE, default scratch/base: `git archive 521de5e | tar -x -C scratch/base`)
#   GPU 2: PEER_OPS (default gla gated_delta_rule simple_gla) bf16 with FLA and jla, one run.py each
# Everything lands in $OUT/all.tgz (the device tool returns at most 8 files).
# Caveat measured in RESULTS.md run 13: JAX paths are timed by wall clock, and the parity
# processes load the host; a JAX row that moves against its fp16 twin is re-timed alone.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:. WHEELS_DONE=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
NG=$(nvidia-smi -L | wc -l)
[ "$NG" -ge 4 ] || { echo "gpu_split.sh needs 4 GPUs, found $NG"; exit 1; }
W=/tmp/split; mkdir -p $W/p $W/r0 $W/r1 $W/g
LIM=${LIM:-545}
BASE=${BASE_TREE:-scratch/base}
( CUDA_VISIBLE_DEVICES=3 OUT=$W/p PAR=12 PARITY_S=500 MODE=parity timeout $LIM \
    bash benchmarks/gpu_run.sh > $W/p/run.log 2>&1 ) &
( CUDA_VISIBLE_DEVICES=0 OUT=$W/r0 MODE=regress BASE_TREE=$BASE REGRESS_OPS="simple_gla delta_rule" \
    BENCH_S=260 timeout $LIM bash benchmarks/gpu_run.sh > $W/r0/run.log 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 OUT=$W/r1 MODE=regress BASE_TREE=$BASE REGRESS_OPS="gated_delta_rule" \
    BENCH_S=260 timeout $LIM bash benchmarks/gpu_run.sh > $W/r1/run.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=2 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tcache2
  for op in ${PEER_OPS:-gla gated_delta_rule simple_gla}; do
    left=$(( LIM - ($(date +%s) - T0) - 5 )); [ $left -lt 30 ] && break
    timeout $left python3 benchmarks/run.py --ops $op --dtypes bf16 --shapes B4T4096 \
      --paths fla jla triton pallas --json $W/g/$op.json 2>&1 | grep -v Warning >> $W/g/bench.txt
  done ) &
wait
echo "wall $(( $(date +%s) - T0 )) s"
for d in r0 r1; do echo "== $d"; cat $W/$d/regress.md 2>/dev/null; done
echo "== peers"; grep -E "ms,|FAILED" $W/g/bench.txt
echo "== parity"
for f in $W/p/p_*.log; do
  echo "$(basename $f): $(grep -E 'comparisons' $f | tail -1) $(grep -cE 'FAIL' $f) FAIL lines"
done
tar czf $OUT/all.tgz -C $W .
