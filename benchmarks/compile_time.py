"""GPU: where a JAX path's first call goes -- trace + lowering, XLA compile, first run -- for
the forward and the training step of one op at one shape (run.py's calls: `jax_case` /
`jla_case`, the same jitted functions).

    PYTHONPATH=. python benchmarks/compile_time.py --op gated_delta_rule --shape B1T32768 \
        --path mosaic [--dtype bf16]

One process per (path, shape): the forward first, then the step, as run.py times them (the
step reuses what the forward compiled where the modules match: Mosaic GPU caches compiled
kernels by their module's hash -- jax 0.11 stamps each lowering anew, see
fla_jax/ops/common/mosaic/kernel_cache.py -- and XLA its autotuning results by the fusion).
The step takes do as an argument, as in training (run.py's default; FLA_BENCH_CONST_DO=1
closes over it: a [B, T, HV, V] constant in the program, ~4 s more XLA compile at B1 T32768).
Also prints JAX's own compile-event durations (trace, jaxpr -> MLIR, backend compile) and the
custom calls in each program. Diagnose XLA's share with XLA_FLAGS=--xla_gpu_autotune_level=0
in a separate process (never a library setting).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gated_delta_rule")
    p.add_argument("--shape", default="B1T32768")
    p.add_argument("--path", default="mosaic", choices=["mosaic", "jla", "pallas"])
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--again", action="store_true",
                   help="then compile a new program around the forward (its output times 2): "
                        "whether the kernels' compiled code is reused within the process")
    a = p.parse_args(argv)

    import jax
    from jax import monitoring

    import run as bench
    events = collections.defaultdict(float)
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.__setitem__(name, events[name] + secs))

    x = bench.make_numpy(a.op, bench.SHAPES[a.shape])
    if a.path == "jla":
        fwd, step, args = bench.jla_programs(a.op, x, a.dtype)
    else:
        fwd, step, args = bench.jax_programs(a.op, x, a.dtype, a.path)
    total = 0.0
    for name, fn in (("fwd", fwd), ("step", step)):
        events.clear()
        fn, prog_args = bench.jitted_program(fn, args)    # do an argument: run.py's default
        t0 = time.perf_counter()
        lowered = fn.lower(*prog_args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        jax.block_until_ready(compiled(*prog_args))
        t3 = time.perf_counter()
        jax.block_until_ready(compiled(*prog_args))
        t4 = time.perf_counter()
        txt = lowered.as_text()
        calls = collections.Counter(re.findall(r"custom_call @(\w+)", txt))
        total += t3 - t0
        ev = {k.rsplit("/", 1)[-1]: round(v, 2) for k, v in events.items() if v > 0.05}
        print(f"{a.path} {a.op} {a.shape} {a.dtype} {name}: lower {t1 - t0:.2f} s, compile "
              f"{t2 - t1:.2f} s, first run {t3 - t2:.2f} s (second {1e3 * (t4 - t3):.1f} ms); "
              f"custom calls {dict(calls)}, dots {txt.count('dot_general')}; events {ev}",
              flush=True)
    if a.again:
        again = jax.jit(lambda *x: fwd(*x) * 2)
        t0 = time.perf_counter()
        lowered = again.lower(*args)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        print(f"{a.path} {a.op} {a.shape} {a.dtype} forward again (a new program): lower "
              f"{t1 - t0:.2f} s, compile {t2 - t1:.2f} s", flush=True)
    print(f"{a.path} {a.op} {a.shape} {a.dtype}: first calls together {total:.1f} s "
          f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
          f"do {'a constant' if os.environ.get('FLA_BENCH_CONST_DO') else 'an argument'})",
          flush=True)
    if a.path != "jla":
        from fla_jax.ops.common.mosaic import compile_ahead as ca
        print(f"  compile ahead {'on' if ca.COMPILE_AHEAD else 'off'}: {len(ca._SEEN)} kernels "
              f"queued, failed {ca.FAILED}", flush=True)


if __name__ == "__main__":
    main()
