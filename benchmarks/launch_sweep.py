"""Whole-op time of one Triton op per launch variant: each variant overrides the launch options
(num_warps, maxnreg, a constexpr such as BK) of one or more engine kernels, by wrapping the
kernel's run(); the wrappers' own launch code is untouched. How the DPLR launches of session 9
were chosen (RESULTS.md run 8): one kernel varied at a time, the whole op timed, the tree's
defaults first.

    PYTHONPATH=. python benchmarks/launch_sweep.py --op rwkv7 --shape B4T4096K64 \\
        --variant "dplr_scores._dplr_scores_fwd:num_warps=2" \\
        --variant "dplr_tail._dplr_tail_bwd:num_warps=8,maxnreg=168"
    PYTHONPATH=. python benchmarks/launch_sweep.py --dry-run --op rwkv7 --variant ...  # CPU

A variant is `module.kernel:opt=val[,opt=val]` (module under fla_torch/ops/common/engine),
several joined by ';'. Values are ints (None for the compiler's choice). GPU: do_bench medians,
fwd and fwd+bwd; --dry-run: a tiny shape, interpreted kernels, one fwd+bwd per variant, and the
number of launches that went through each override (0: the op never launches that kernel; a
name that does not exist raises).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

ENGINE = "fla_torch.ops.common.engine"


def parse_variant(text: str) -> list:
    """'mod.kernel:a=1,b=None;mod2.k2:c=3' -> [(module, kernel, {opt: value})]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, opts = part.partition(":")
        mod, _, kern = name.rpartition(".")
        if not mod or not kern or not opts:
            raise ValueError(f"variant {part!r}: expected 'module.kernel:opt=val[,opt=val]'")
        vals = {}
        for kv in opts.split(","):
            k, _, v = kv.partition("=")
            if not k or not v:
                raise ValueError(f"variant {part!r}: option {kv!r} is not opt=val")
            vals[k.strip()] = None if v.strip() == "None" else int(v)
        out.append((mod, kern, vals))
    return out


class Overrides:
    """Context manager: wraps each named kernel's run() so that its launches take `opts`;
    counts the launches that went through each wrapper."""

    def __init__(self, spec):
        self.spec, self.count, self._kernels = spec, {}, []

    def __enter__(self):
        for mod, kern, opts in self.spec:
            fn = getattr(importlib.import_module(f"{ENGINE}.{mod}"), kern)
            key = f"{mod}.{kern}"
            self.count[key] = 0
            orig = type(fn).run.__get__(fn)

            def run(*a, _orig=orig, _opts=opts, _key=key, **k):
                self.count[_key] += 1
                return _orig(*a, **{**k, **_opts})
            fn.run = run
            self._kernels.append(fn)
        return self

    def __exit__(self, *exc):
        for fn in self._kernels:
            del fn.run


def main(argv=None):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run as bench
    p = argparse.ArgumentParser()
    p.add_argument("--op", required=True)
    p.add_argument("--shape", default="B4T4096")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--variant", action="append", default=[],
                   help="module.kernel:opt=val[,opt=val][;...] (repeat for more variants)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    variants = [("default", [])] + [(v, parse_variant(v)) for v in args.variant]
    if args.dry_run:
        shape, device = dict(B=1, T=70, H=2, HV=2, K=16, V=16, M=16), "cpu"
    else:
        shape, device = bench.SHAPES[args.shape], "cuda"
    x = bench.make_numpy(args.op, shape)
    fwd, fb, params = bench.torch_case(args.op, x, args.dtype, "triton", device=device)
    rows = []
    for label, spec in variants:
        with Overrides(spec) as ov:
            if args.dry_run:
                fb()
                row = dict(variant=label, launches=dict(ov.count))
                print(f"dry run {args.op} {args.dtype} [{label}]: launches {ov.count}",
                      flush=True)
            else:
                import torch
                import triton
                t0 = time.perf_counter()
                fb()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                t = [triton.testing.do_bench(f, warmup=20, rep=120, grad_to_none=params,
                                             return_mode="median") for f in (fwd, fb)]
                row = dict(variant=label, fwd_ms=t[0], fwdbwd_ms=t[1], first_s=first)
                print(f"{args.op} {args.dtype} [{label}]: fwd {t[0]:.3f} ms, fwd+bwd "
                      f"{t[1]:.3f} ms (first {first:.1f} s)", flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
