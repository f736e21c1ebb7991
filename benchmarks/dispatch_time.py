"""Is a jitted program host-bound? Host enqueue time against wall time per call (GPU script).

For run.py's jitted forward and training step of each op, path and shape: `enqueue` is the time
to issue `inner` calls (no wait), `wall` the time until the last one is done, both per call,
median of `loops`. When enqueue < wall the device is the bottleneck and the wall per call is its
work plus the gaps between kernels; when they are equal the host is.

    python3 benchmarks/dispatch_time.py --ops simple_gla gated_delta_rule --shapes B4T4096 \
        --paths mosaic jla
(RESULTS.md run 26: simple GLA's forward, ours / jla, enqueue 67 / 70 us, wall 106 / 102.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def measure(fn, args, inner: int = 10, loops: int = 15):
    """(enqueue, wall) microseconds per call of fn(*args), medians over `loops` loops of
    `inner` calls (two warm-up calls first)."""
    import jax
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    enq, wall = [], []
    for _ in range(loops):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(inner)]
        t1 = time.perf_counter()
        jax.block_until_ready(outs)
        t2 = time.perf_counter()
        enq.append((t1 - t0) * 1e6 / inner)
        wall.append((t2 - t0) * 1e6 / inner)
    return statistics.median(enq), statistics.median(wall)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--ops", nargs="+", default=["simple_gla"])
    p.add_argument("--shapes", nargs="+", default=["B4T4096"])
    p.add_argument("--paths", nargs="+", default=["mosaic", "jla"])
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--inner", type=int, nargs="+", default=[10, 100])
    a = p.parse_args(argv)

    import run as bench
    for shape in a.shapes:
        for op in a.ops:
            x = bench.make_numpy(op, bench.SHAPES[shape])
            for path in a.paths:
                fwd, step, args = (bench.jla_programs(op, x, a.dtype) if path == "jla"
                                   else bench.jax_programs(op, x, a.dtype, path))
                for name, fn in (("fwd", fwd), ("step", step)):
                    cells = []
                    for inner in a.inner:
                        e, w = measure(fn, args, inner=inner, loops=15 if inner <= 10 else 5)
                        cells.append(f"{inner} calls: enqueue {e:.1f}, wall {w:.1f}")
                    print(f"{shape} {op} {a.dtype} {path} {name}: " + "; ".join(cells) +
                          " (us per call)", flush=True)


if __name__ == "__main__":
    main()
