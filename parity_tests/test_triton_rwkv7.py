"""Triton chunk_rwkv7 (the DPLR chunk pipeline, common/engine/dplr.py): the cases that
test_ops.py's CPU kernel subset leaves out, on the shared harness (cases.Case, harness.check:
one input generator, the float64 oracle, NaN-poisoned allocations, one metric and the one
tolerance table).

Covered here: varlen with an empty sequence and sequences shorter than a chunk, per-key decays
down to -20 in fp32 (short_strong) and every decay in [-20, -10] in fp16 (uniform_strong), no
initial state with K != V and weak decays (t63_kv_weak). Interpreted on CPU
(TRITON_INTERPRET=1, set by conftest) or on a GPU with PARITY_DEVICE=cuda.
"""
from __future__ import annotations

import os

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import triton  # noqa: E402,F401  (the suite needs every framework: no silent skip)

from parity_tests import triton_interpret_patch  # noqa: E402
from parity_tests.harness import check  # noqa: E402

triton_interpret_patch.apply()

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"

CHUNK = [("short_strong", "fp32"), ("uniform_strong", "fp16"), ("t63_kv_weak", "fp32")]


@pytest.mark.parametrize("case,dtype", CHUNK, ids=[f"{c}-{d}" for c, d in CHUNK])
def test_chunk_rwkv7_triton(case, dtype):
    rows = check("chunk_rwkv7", case, dtype, {"torch": "triton"}, device=DEVICE)
    bad = [f"{r.compared} {r.tensor} err={r.error:.3e} tol={r.tolerance:.1e}"
           for r in rows if not r.passed]
    assert rows and not bad, "\n".join(bad)
