"""Parity CLI: `python -m parity_tests [--ops ...] [--dtypes ...] [--impls ...] [--json F]`
(installed as `fla-parity`).

Runs the chosen ops on the chosen cases in both frameworks and prints a legend (what is
compared, the metric, the tolerances, device and library versions), then one table: op, case,
dtype, what was compared, the error per tensor (RMS(a-b)/RMS(ref)) and pass/fail. Exit status
1 if any row fails, 2 if the requested device is not there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time


def _epilog() -> str:
    from .cases import CPU_CASES, GPU_CASES, OPS
    from .report import METRIC

    def case_line(c):
        extra = [f"cu_seqlens={list(c.cu_seqlens)}"] if c.cu_seqlens else []
        extra += [f"HV={c.HV}"] if c.HV != c.H else []
        if c.families == ("attention",):      # softmax attention: HV query over H k/v heads
            extra += ([] if c.causal else ["non-causal"]) + (
                [f"window={c.window}"] if c.window is not None else []) + ["only attention"]
            return (f"  {c.name:18s} B={c.B} T={c.T} H={c.H} K={c.K} V={c.V} "
                    f"{' '.join(extra)}; {'/'.join(c.dtypes)}")
        extra += [f"gates -{c.strength:g}/token"] if c.strength else []
        extra += [f"gate_mode={c.gate_mode}"] if c.gate_mode != "g" else []
        extra += ["l2norm"] if c.l2norm else []
        extra += [f"beta<{c.beta_max:g}"] if c.beta_max != 1.0 else []
        extra += ["beta at its edges"] if c.beta_edges else []
        extra += ["no h0"] if not c.h0 else []
        extra += [f"only {','.join(c.families)}"] if len(c.families) < 4 else []
        return (f"  {c.name:18s} B={c.B} T={c.T} H={c.H} K={c.K} V={c.V} {' '.join(extra)}; "
                f"{'/'.join(c.dtypes)}")
    return "\n".join(
        ["ops:"] + textwrap.wrap(" ".join(OPS), 88, initial_indent="  ", subsequent_indent="  ")
        + [
         "cases on cpu (default: basic varlen attn_basic attn_varlen):"]
        + [case_line(c) for c in CPU_CASES]
        + ["cases on cuda (default: all of them):"] + [case_line(c) for c in GPU_CASES]
        + [""] + textwrap.wrap(METRIC + "; tolerances per dtype and tensor in "
                               "parity_tests/cases.py (TOLERANCE), printed with the report.", 88)
        + [
           "Exit status: 0 all passed, 1 a comparison failed, 2 the requested device is "
           "missing."])


def _parse(argv):
    from .cases import CPU_CASES, DTYPES, GPU_CASES, OPS
    p = argparse.ArgumentParser(prog="python -m parity_tests",
                                description=__doc__.split("\n")[0], epilog=_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS), metavar="OP",
                   help="ops to check (default: all)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--impls", nargs="+", default=["default"],
                   choices=["default", "kernel", "mosaic"],
                   help="'default': chunked / reference (CPU path); 'kernel': Pallas + Triton "
                        "(interpreted on CPU, slow); 'mosaic': fla_jax's Pallas Mosaic GPU "
                        "kernels (Hopper) + Triton, on the ops that have them; a case or dtype "
                        "they cannot take is listed as skipped with the reason")
    p.add_argument("--frameworks", nargs="+", default=["jax", "torch"], choices=["jax", "torch"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--cases", nargs="+", default=None, metavar="CASE",
                   choices=[c.name for c in CPU_CASES + GPU_CASES],
                   help="case names (default: 'basic' 'varlen' 'attn_basic' 'attn_varlen' on "
                        "cpu, all GPU cases on cuda; listed below)")
    p.add_argument("--json", metavar="PATH", help="also write all rows as JSON")
    return p.parse_args(argv)


def missing_gpu(frameworks) -> str | None:
    """Why --device cuda cannot run here (one line), or None when every framework sees a GPU."""
    if "torch" in frameworks:
        import torch
        if not torch.cuda.is_available():
            return ("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False, "
                    f"torch {torch.__version__}); run with --device cpu")
    if "jax" in frameworks:
        import jax
        try:
            jax.devices("gpu")
        except RuntimeError:
            return (f"--device cuda: jax sees no GPU (jax {jax.__version__}, devices "
                    f"{[d.platform for d in jax.devices()]}); run with --device cpu")
    return None


def main(argv=None) -> int:
    args = _parse(argv)
    if args.device == "cuda":
        why = missing_gpu(args.frameworks)
        if why:
            print(f"fla-parity: {why}", file=sys.stderr)
            return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from . import CPU_XLA_FLAGS
        os.environ.setdefault("XLA_FLAGS", CPU_XLA_FLAGS)
    os.environ["PARITY_DEVICE"] = args.device
    if args.device == "cpu" and "kernel" in args.impls and "torch" in args.frameworks:
        from . import triton_interpret_patch
        triton_interpret_patch.apply()
    from .cases import CASES, GPU_CASES, OPS
    from .harness import cannot_take, check, resolve
    from .report import group_lines, header, legend, tolerance_lines

    names = args.cases or (["basic", "varlen", "attn_basic", "attn_varlen"]
                           if args.device == "cpu" else [c.name for c in GPU_CASES])
    rows, skipped, cannot, t0 = [], [], [], time.time()
    for line in legend(args.device, args.frameworks):
        print(line)
    print()
    print(header())
    print("-" * len(header()))
    for line in tolerance_lines(args.dtypes):
        print(line)
    print("-" * len(header()))
    for op in args.ops:
        for name in names:
            if not CASES[name].applies_to(OPS[op]):
                continue
            for dtype in [d for d in args.dtypes if d in CASES[name].dtypes]:
                for kind in args.impls:
                    impls = {fw: resolve(fw, op, kind) for fw in args.frameworks}
                    if kind == "mosaic" and impls.get("jax") is None:
                        skipped.append(f"{op} mosaic (jax)")   # Triton alone: 'kernel' runs it
                        continue
                    missing = [fw for fw, i in impls.items() if i is None]
                    skipped += [f"{op} {kind} ({fw})" for fw in missing]
                    impls = {fw: i for fw, i in impls.items() if i is not None}
                    if not impls:
                        continue
                    why = cannot_take(op, name, dtype, impls)
                    if why:
                        cannot.append(f"{op} {name} {dtype} {why}")
                        print(f"skipped {op} {name} {dtype} {why}", flush=True)
                        continue
                    got = check(op, name, dtype, impls, device=args.device)
                    rows += got
                    for line in group_lines(got):
                        print(line, flush=True)
    failed = [r for r in rows if not r.passed]
    print("-" * len(header()))
    print(f"{len(rows)} comparisons, {len(failed)} failed, {time.time() - t0:.0f} s"
          f"{'; not registered: ' + ', '.join(sorted(set(skipped))) if skipped else ''}"
          f"{'; ' + str(len(cannot)) + ' cells an implementation cannot take' if cannot else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [r.as_dict() for r in rows], "device": args.device,
                       "not_registered": sorted(set(skipped)),
                       "cannot_take": cannot}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
