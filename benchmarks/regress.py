"""No-regression table: two run.py JSON files (a base revision's and this tree's, timed in the
same GPU call) row by row; ratio = this tree / base for fwd and fwd+bwd.

    python benchmarks/regress.py base.json new.json [--limit 1.05] [--paths triton pallas]
    (base and new: a run.py JSON file each, or a directory of them)

A row is flagged REGRESSED when either ratio exceeds --limit (issue 10's bar: 5%); rows that
exist on one side only, or failed on either side, are listed, never dropped. Exit status 1 when
any row is flagged or missing on the new side.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def _rows(path: str, paths) -> dict:
    """The rows of one run.py JSON file, or of every *.json file in a directory."""
    files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    rows = {}
    for name in files:
        with open(name) as f:
            rows.update({(r["shape"], r["op"], r["dtype"], r["path"]): r
                         for r in json.load(f)["rows"] if paths is None or r["path"] in paths})
    return rows


def compare(base: dict, new: dict, limit: float) -> tuple[list[str], bool]:
    """(report lines, any row flagged or missing on the new side)."""
    lines = ["| shape | op | dtype | path | base fwd / fwd+bwd ms | new fwd / fwd+bwd ms | ratio | |",
             "|---|---|---|---|---|---|---|---|"]
    bad = False
    for key in sorted(set(base) | set(new)):
        b, n = base.get(key), new.get(key)
        label = " | ".join(key)
        if b is None or "error" in b:
            lines.append(f"| {label} | {'missing' if b is None else b['error'][:60]} | | | new only |")
            continue
        if n is None or "error" in n:
            lines.append(f"| {label} | {b['fwd_ms']:.3f} / {b['fwdbwd_ms']:.3f} | "
                         f"{'missing' if n is None else n['error'][:60]} | | MISSING |")
            bad = True
            continue
        rf, rb = n["fwd_ms"] / b["fwd_ms"], n["fwdbwd_ms"] / b["fwdbwd_ms"]
        flag = "REGRESSED" if max(rf, rb) > limit else ""
        bad |= bool(flag)
        lines.append(f"| {label} | {b['fwd_ms']:.3f} / {b['fwdbwd_ms']:.3f} | "
                     f"{n['fwd_ms']:.3f} / {n['fwdbwd_ms']:.3f} | {rf:.2f} / {rb:.2f} | {flag} |")
    return lines, bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--limit", type=float, default=1.05)
    p.add_argument("--paths", nargs="+", default=None,
                   help="only these run.py paths (default: every path in either file)")
    args = p.parse_args(argv)
    lines, bad = compare(_rows(args.base, args.paths), _rows(args.new, args.paths), args.limit)
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
