"""GPU: where a Mosaic path's first call goes, kernel by kernel. Each Pallas kernel of run.py's
forward and training step of one op at one shape is lowered and compiled alone (a jitted program
of that one kernel), in program order: forward first, then the step, as run.py's first calls
run them. A kernel whose module the process compiled before (Mosaic GPU caches compiled kernels
by their module's hash) shows its lowering time and a near-zero compile.

    PYTHONPATH=. python benchmarks/kernel_compile_time.py --op gated_delta_rule --shape B1T32768

With MOSAIC_GPU_DUMP_PTX=1 Mosaic prints each compiled kernel's PTX to stdout (run with stdout
to a file, then `ptxas -arch=sm_90a` times the assembler's share on any machine).
--lower-only lowers for CUDA without a GPU (export_for_cuda): the lowering column alone.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def kernel_eqns(jaxpr):
    """The Pallas kernel equations of a jaxpr, nested calls included, in program order."""
    for e in jaxpr.eqns:
        if e.primitive.name in KERNEL_PRIMITIVES:
            yield e
            continue
        for v in e.params.values():
            for s in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(s, "jaxpr", s)
                if hasattr(inner, "eqns"):
                    yield from kernel_eqns(inner)


def kernel_name(e) -> str:
    n = e.params.get("name")
    if n is None:
        n = e.params.get("name_and_src_info", "?")
    return str(getattr(n, "name", n))


def alone(e):
    """(function binding the kernel equation alone, its argument avals)."""
    from jax._src import core
    lits = {i: v.val for i, v in enumerate(e.invars) if isinstance(v, core.Literal)}
    avals = [v.aval for i, v in enumerate(e.invars) if i not in lits]

    def f(*xs):
        it = iter(xs)
        args = [lits[i] if i in lits else next(it) for i in range(len(e.invars))]
        return e.primitive.bind(*args, **e.params)
    return f, avals


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gated_delta_rule")
    p.add_argument("--shape", default="B1T32768")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--lower-only", action="store_true")
    a = p.parse_args(argv)

    import jax

    import run as bench
    from fla_jax.ops.common.mosaic import export_for_cuda
    from fla_jax.ops.common.mosaic import lowering as mosaic_lowering
    x = bench.make_numpy(a.op, bench.SHAPES[a.shape])
    fwd, step, args = bench.jax_programs(a.op, x, a.dtype, "mosaic")
    print(f"{a.op} {a.shape} {a.dtype}, jax {jax.__version__}, "
          f"{'lowering only' if a.lower_only else jax.devices()[0].device_kind}", flush=True)
    print("| program | kernel | lower s | compile s |\n|---|---|---|---|", flush=True)
    totals = {}
    for prog, fn in (("fwd", fwd), ("step", step)):
        # without a GPU, trace as export_for_cuda does (which resets this after each export)
        mosaic_lowering._LOWERING_ONLY[0] = a.lower_only
        fn, prog_args = bench.jitted_program(fn, args)    # do an argument: run.py's default
        prog_sds = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in prog_args]
        eqns = list(kernel_eqns(fn.trace(*prog_sds).jaxpr.jaxpr))
        for e in eqns:
            f, avals = alone(e)
            shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in avals]
            t0 = time.perf_counter()
            if a.lower_only:
                export_for_cuda(f, *shapes)
                lo, co = time.perf_counter() - t0, float("nan")
            else:
                lowered = jax.jit(f).lower(*shapes)
                t1 = time.perf_counter()
                lowered.compile()
                lo, co = t1 - t0, time.perf_counter() - t1
            tl, tc = totals.get(prog, (0.0, 0.0))
            totals[prog] = (tl + lo, tc + co)
            print(f"| {prog} | {kernel_name(e)} | {lo:.2f} | {co:.2f} |", flush=True)
    for prog, (tl, tc) in totals.items():
        print(f"| {prog} | all | {tl:.2f} | {tc:.2f} |", flush=True)


if __name__ == "__main__":
    main()
