"""Registers and spills of an op's Mosaic GPU kernels (GPU): ptxas' report per kernel, from
Mosaic GPU's MOSAIC_GPU_DUMP_PTXAS=1, for the tree's defaults and for each variant
(pallas_launch_sweep.py's `<module>:NAME=value` overrides). Each variant compiles the op's
fwd+bwd at a small shape of run.py's K / V in a child process (ptxas writes from C++).

    PYTHONPATH=. python benchmarks/mosaic_ptxas.py --op gated_delta_rule \\
        --variant "fla_jax.ops.gated_delta_rule.mosaic_bwd_grads:BATCH=0"

One line per kernel: registers per thread, stack frame and spill bytes (a spill is local
memory traffic inside the kernel's inner work: what to remove first).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ENTRY = re.compile(r"Compiling entry function '([^']+)'")
PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGS = re.compile(r"Used (\d+) registers")


def parse(text: str) -> list[tuple[str, str]]:
    """ptxas -v text -> [(kernel, 'N regs, stack S B, spills st/ld B')] in order."""
    out, name, props = [], None, ""
    for line in text.splitlines():
        if m := ENTRY.search(line):
            name, props = m.group(1), ""
        elif (m := PROPS.search(line)) and name:
            props = f"stack {m.group(1)} B, spill stores {m.group(2)} B, loads {m.group(3)} B"
        elif (m := REGS.search(line)) and name:
            out.append((name, f"{m.group(1)} registers" + (f", {props}" if props else "")))
            name = None
    return out


def child(op: str, dtype: str, spec_text: str, T: int) -> int:
    sys.path.insert(0, HERE)
    import jax

    import run as bench
    from pallas_launch_sweep import Override, parse_variant
    shape = dict(bench.SHAPES["B4T4096"], B=1, T=T)
    x = bench.make_numpy(op, shape)
    with Override(parse_variant(spec_text) if spec_text else []):
        _, fb = bench.jax_case(op, x, dtype, "mosaic")
        jax.block_until_ready(fb())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--op", required=True)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--T", type=int, default=256,
                   help="tokens (B=1, H=16); 4096 takes the delta family's sequence split")
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        return child(args.op, args.dtype, args.child, args.T)
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
    for variant in [""] + args.variant:
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--op", args.op,
                              "--dtype", args.dtype, "--T", str(args.T), "--child", variant],
                             env=env, capture_output=True, text=True)
        rows = parse(res.stdout + res.stderr)
        print(f"{args.op} {args.dtype} [{variant or 'default'}]"
              + ("" if res.returncode == 0 else f" FAILED (exit {res.returncode}): "
                 + (res.stderr.strip().splitlines() or [''])[-1][:200]), flush=True)
        for name, info in rows:
            print(f"  {name}: {info}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
