#!/usr/bin/env bash
# One GPU session: kernel parity at GPU shapes, then the benchmark, results under $OUT.
# Run from the repo root on the GPU machine (carry .whl for fla-core + einops).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PARITY_DEVICE=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:.
fi
export PYTHONPATH=${PYTHONPATH:-.}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
OPS=${OPS:-"chunk_simple_gla fused_recurrent_simple_gla"}
timeout ${PARITY_S:-200} python3 -m parity_tests --device cuda --impls kernel --ops $OPS \
  --json "$OUT/parity.json" 2>&1 | tee "$OUT/parity.txt" | tail -n 60
timeout ${BENCH_S:-150} python3 benchmarks/run.py --ops ${BENCH_OPS:-simple_gla} \
  --paths ${BENCH_PATHS:-triton pallas torch-chunked jax-chunked sdpa} \
  --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -n 40
if [ -n "${FLA_S:-}" ]; then
  timeout "$FLA_S" python3 benchmarks/run.py --ops simple_gla --dtypes bf16 --shapes B4T4096 \
    --paths fla triton pallas --json "$OUT/bench_fla.json" 2>&1 | tee "$OUT/bench_fla.txt" | tail -n 12
fi
