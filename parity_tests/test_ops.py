"""Every op x implementation x dtype x framework: outputs, final states and every gradient
against the float64 oracle, and JAX against torch directly.

impl 'default' is the CPU path (chunk_* -> 'chunked', fused_recurrent_* -> 'reference');
impl 'kernel' is Pallas (JAX) and Triton (torch), interpreted on CPU. PARITY_DEVICE=cuda runs
the GPU cases on a GPU instead.
"""
from __future__ import annotations

import os

import pytest

from .cases import CPU_CASES, GPU_CASES, OPS
from .harness import FRAMEWORKS, check, resolve

DEVICE = os.environ.get("PARITY_DEVICE", "cpu")
CASE_SET = GPU_CASES if DEVICE == "cuda" else CPU_CASES


# Interpreted kernels are slow on CPU (a Python/XLA loop per program and token), so in CI the
# kernels run this subset here, while test_pallas_*.py / test_triton_*.py check every kernel
# feature against float64 in detail. On a GPU every case runs for the kernels too.
# basic runs the kernels in bf16 only, short_strong in fp16 only: one 16-bit dtype per case (an
# interpreted kernel runs the same program text in bf16 and fp16; the second 16-bit row of each
# was ~460 s of CI CPU time), both 16-bit dtypes per op still; fp32 rows: varlen (h0, several
# chunks and sequences), uniform_strong, beta_edges / gamma. On a GPU every case runs in every
# dtype. The kernel files' own cases (test_pallas_*.py, test_triton_*.py) cover the rest.
KERNEL_CPU_CASES = {"basic": ("bf16",), "varlen": ("fp32",),
                    "short_strong": ("fp16",), "gamma": ("fp32",), "gqa_l2_beta2": ("bf16",),
                    "beta_edges": ("fp32",), "uniform_strong": ("fp32",)}


def _params():
    """Grouped by (family, case, dtype), the key of the cached float64 oracle
    (harness.oracle): a family's ops and kinds run next to each other (xdist hands a worker
    consecutive tests), so the token-loop oracle runs once per group rather than per op."""
    families = dict.fromkeys(spec.family for spec in OPS.values())
    for family in families:
        for case in CASE_SET:
            for dtype in case.dtypes:
                for op, spec in OPS.items():
                    if spec.family != family or not case.applies_to(spec):
                        continue
                    for kind in ("default", "kernel"):
                        if (kind == "kernel" and DEVICE != "cuda"
                                and dtype not in KERNEL_CPU_CASES.get(case.name, ())):
                            continue
                        yield pytest.param(op, case.name, dtype, kind,
                                           id=f"{op}-{case.name}-{dtype}-{kind}")


def format_rows(rows) -> str:
    return "\n".join(f"  {r.compared:34s} {r.tensor:6s} err={r.error:.3e} tol={r.tolerance:.1e}"
                     f" {'ok' if r.passed else 'FAIL'}" for r in rows)


@pytest.mark.parametrize("op,case,dtype,kind", list(_params()))
def test_parity(op, case, dtype, kind):
    impls = {fw: resolve(fw, op, kind) for fw in FRAMEWORKS}
    impls = {fw: i for fw, i in impls.items() if i is not None}
    if not impls:
        pytest.skip(f"no {kind} implementation of {op} is registered in either framework")
    rows = check(op, case, dtype, impls, device=DEVICE)
    assert rows and all(r.passed for r in rows), "\n" + format_rows(rows)


def test_interpreted_dtypes(monkeypatch):
    """The kernel files' CPU dtype thinning: fp32 and one 16-bit dtype alternating by case index,
    both 16-bit dtypes over a file; every dtype on a GPU run."""
    from .cases import interpreted_dtypes
    monkeypatch.setenv("PARITY_DEVICE", "cpu")
    every = ("fp32", "bf16", "fp16")
    assert interpreted_dtypes(0, every) == ("fp32", "bf16")
    assert interpreted_dtypes(1, every) == ("fp32", "fp16")
    assert interpreted_dtypes(3, ("fp32", "bf16")) == ("fp32", "bf16")
    assert interpreted_dtypes(2, ("fp16",)) == ("fp16",)
    monkeypatch.setenv("PARITY_DEVICE", "cuda")
    assert interpreted_dtypes(1, every) == every
