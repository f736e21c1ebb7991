"""Text of the parity report: legend, tolerance lines, one fixed-width row per comparison group.

A row is (op, case, dtype, compared) with one cell per tensor: RMS(a - b) / RMS(ref), a '!'
after a cell over its tolerance, '-' where the op produces no such tensor.
"""
from __future__ import annotations

import importlib.metadata
import platform
import textwrap

from .cases import CASES, CROSS_FACTOR, OPS, TENSORS, TOLERANCE

IMPL_NAMES = ("reference", "chunked", "pallas", "triton")
OP_W = max(len(o) for o in OPS)
CASE_W = max(len(c) for c in CASES)
DTYPE_W = 5
COMPARED_W = max(max(len(f"jax:{a} vs torch:{b}") for a in IMPL_NAMES for b in IMPL_NAMES),
                 max(len(f"{fw}:{a} vs fp64") for fw in ("jax", "torch") for a in IMPL_NAMES))
CELL_W = 8
RESULT = "result"

METRIC = ("metric: RMS(a - b) / RMS(ref) per tensor, ref = the float64 oracle (fla_torch's "
          "token-by-token reference in float64, autograd for gradients, fed the same rounded "
          "inputs)")


def legend(device: str, frameworks) -> list[str]:
    """The lines printed before the table."""
    text = ("Compared: each framework's implementation against the float64 oracle "
            "('<fw>:<impl> vs fp64'), and JAX against torch directly ('jax:<impl> vs "
            f"torch:<impl>'). {METRIC[0].upper() + METRIC[1:]}. Tensors: o output, ht final "
            "state, dq dk dv dg dbeta dh0 gradients; '-' = the op has no such tensor; '!' = over "
            "its tolerance. Tolerances (parity_tests/cases.py TOLERANCE, per dtype and tensor) "
            f"are the 'tolerance' rows under the header; jax-vs-torch rows get {CROSS_FACTOR:g}x "
            "them. 'comparisons' in the total counts cells (one tensor of one row); a row passes "
            "when all its cells pass.")
    return textwrap.wrap(text, 100) + [f"Environment: {environment(device, frameworks)}"]


def tolerance_lines(dtypes) -> list[str]:
    """One row per dtype with the per-tensor tolerance against fp64, in the table's columns."""
    return [row_text("tolerance", "", d, f"vs fp64 (x{CROSS_FACTOR:g} jax vs torch)",
                     [f"{TOLERANCE[d][t]:.1e}" for t in TENSORS], "") for d in dtypes]


def environment(device: str, frameworks) -> str:
    """'device ...; python x, torch y, ...' from installed package metadata (no imports)."""
    pkgs = []
    for name in ("torch", "triton", "jax", "jaxlib", "flax"):
        if name in ("torch", "triton") and "torch" not in frameworks:
            continue
        if name in ("jax", "jaxlib", "flax") and "jax" not in frameworks:
            continue
        try:
            pkgs.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pkgs.append(f"{name} (not installed)")
    return f"device {device_name(device)}; python {platform.python_version()}, " + ", ".join(pkgs)


def device_name(device: str) -> str:
    if device == "cuda":
        try:
            import torch
            return f"cuda ({torch.cuda.get_device_name(0)})"
        except Exception:      # torch absent: the jax-only run names the platform only
            return "cuda"
    return f"cpu ({platform.machine()}; kernels interpreted)"


def row_text(op: str, case: str, dtype: str, compared: str, cells, result: str) -> str:
    return (f"{op:{OP_W}s} {case:{CASE_W}s} {dtype:{DTYPE_W}s} {compared:{COMPARED_W}s} "
            + " ".join(f"{c:>{CELL_W}s}" for c in cells) + f"  {result}").rstrip()


def header() -> str:
    return row_text("op", "case", "dtype", "compared", list(TENSORS), RESULT)


def group_lines(rows) -> list[str]:
    """One line per (op, case, dtype, compared) group of harness Rows."""
    by = {}
    for r in rows:
        by.setdefault((r.op, r.case, r.dtype, r.compared), {})[r.tensor] = r
    lines = []
    for (op, case, dtype, compared), ts in by.items():
        cells = []
        for t in TENSORS:
            r = ts.get(t)
            cells.append("-" if r is None else f"{r.error:.1e}" + ("" if r.passed else "!"))
        ok = all(r.passed for r in ts.values())
        lines.append(row_text(op, case, dtype, compared, cells, "pass" if ok else "FAIL"))
    return lines
