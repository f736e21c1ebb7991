"""Every Triton kernel launch of every op compiles for sm_90 (H100) on this CPU machine.

The interpreter runs programs the compiler rejects (a value re-bound to another shape in an
`if`, a loop-carried value that changes type: both passed CI and failed on the H100), so each
op with a Triton implementation is called here in every kernel dtype at two small cases (one
fixed-length with h0, one varlen), forward and backward, with its launches recorded instead
of run (parity_tests/triton_compile_check.py), and every distinct launch is compiled in a
process without TRITON_INTERPRET through the LLVM lowering. A failure names the kernel, its
constexprs and the compiler's error.
"""
from __future__ import annotations

import pytest

from .cases import CASES, OPS
from .harness import inputs
from .torch_runner import registry, run
from .triton_compile_check import compile_launches, distinct, record_launches

CASE_NAMES = ("basic", "varlen")


def _triton_ops():
    for op, spec in OPS.items():
        try:
            impls = registry(spec)
        except ModuleNotFoundError:
            continue
        if "triton" in impls:
            yield op


@pytest.mark.parametrize("op", list(_triton_ops()))
def test_triton_launches_compile_for_sm90(op, tmp_path):
    records, ops_run = [], []
    spec = OPS[op]
    for name in CASE_NAMES:
        case = CASES[name]
        if not case.applies_to(spec):
            continue
        for dtype in ("bf16", "fp16", "fp32"):
            with record_launches() as rec:
                try:
                    run(spec, case, "triton", dtype, inputs(op, name, dtype))
                except AssertionError:
                    pass   # outputs of kernels that did not run: only the launches count
            records += rec
            ops_run.append((op, name, dtype, len(rec)))
    assert ops_run and all(n > 0 for *_, n in ops_run), ops_run
    launches = distinct(records)
    failures = compile_launches(launches, tmp_path)
    assert not failures, "\n\n".join(
        f"{f['kernel']} num_warps={f['num_warps']} {f['args']}\n{f['error']}"
        for f in failures)
