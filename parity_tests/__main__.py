"""Parity CLI: `python -m parity_tests [--ops ...] [--dtypes ...] [--impls ...] [--json F]`.

Runs the chosen ops on the chosen cases in both frameworks and prints one table: op, case,
dtype, what was compared, the error per tensor (RMS(a-b)/RMS(ref)), the tolerance and
pass/fail. Exit status 1 if any row fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse(argv):
    from .cases import CPU_CASES, DTYPES, GPU_CASES, OPS
    p = argparse.ArgumentParser(prog="python -m parity_tests", description=__doc__.split("\n")[0])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS), metavar="OP",
                   help="ops to check (default: all)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--impls", nargs="+", default=["default"], choices=["default", "kernel"],
                   help="'default': chunked / reference (CPU path); 'kernel': Pallas + Triton "
                        "(interpreted on CPU, slow)")
    p.add_argument("--frameworks", nargs="+", default=["jax", "torch"], choices=["jax", "torch"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--cases", nargs="+", default=None,
                   help=f"case names (default: 'basic' 'varlen' 'attn_basic' 'attn_varlen' on cpu, "
                        f"all GPU cases on cuda); "
                        f"known: {', '.join(c.name for c in CPU_CASES + GPU_CASES)}")
    p.add_argument("--json", metavar="PATH", help="also write all rows as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                                           "--xla_llvm_disable_expensive_passes=true")
    os.environ["PARITY_DEVICE"] = args.device
    if args.device == "cpu" and "kernel" in args.impls and "torch" in args.frameworks:
        from . import triton_interpret_patch
        triton_interpret_patch.apply()
    from .cases import CASES, GPU_CASES, OPS
    from .harness import check, resolve

    names = args.cases or (["basic", "varlen", "attn_basic", "attn_varlen"]
                           if args.device == "cpu" else [c.name for c in GPU_CASES])
    rows, skipped, t0 = [], [], time.time()
    header = f"{'op':34s} {'case':12s} {'dtype':5s} {'compared':30s} " + \
             "  ".join(f"{t:>8s}" for t in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")) + \
             "  result"
    print(header)
    print("-" * len(header))
    for op in args.ops:
        for name in names:
            if not CASES[name].applies_to(OPS[op]):
                continue
            for dtype in [d for d in args.dtypes if d in CASES[name].dtypes]:
                for kind in args.impls:
                    impls = {fw: resolve(fw, op, kind) for fw in args.frameworks}
                    missing = [fw for fw, i in impls.items() if i is None]
                    skipped += [f"{op} {kind} ({fw})" for fw in missing]
                    impls = {fw: i for fw, i in impls.items() if i is not None}
                    if not impls:
                        continue
                    got = check(op, name, dtype, impls, device=args.device)
                    rows += got
                    _print_group(got)
    failed = [r for r in rows if not r.passed]
    print("-" * len(header))
    print(f"{len(rows)} comparisons, {len(failed)} failed, {time.time() - t0:.0f} s"
          f"{'; not registered: ' + ', '.join(sorted(set(skipped))) if skipped else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [r.as_dict() for r in rows], "device": args.device,
                       "not_registered": sorted(set(skipped))}, f, indent=1)
    return 1 if failed else 0


def _print_group(rows):
    by = {}
    for r in rows:
        by.setdefault((r.op, r.case, r.dtype, r.compared), {})[r.tensor] = r
    for (op, case, dtype, compared), ts in by.items():
        cells = []
        for t in ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"):
            r = ts.get(t)
            cells.append(f"{r.error:8.1e}" if r else f"{'-':>8s}")
        ok = all(r.passed for r in ts.values())
        tol = max(r.tolerance for r in ts.values())
        print(f"{op:34s} {case:12s} {dtype:5s} {compared:30s} " + "  ".join(cells) +
              f"  {'pass' if ok else 'FAIL'} (tol<={tol:.0e})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
