"""Triton chunk_kda and chunk_rwkv7 (the DPLR chunk pipeline, common/engine/dplr.py): the
cases that test_ops.py's CPU kernel subset leaves out, on the shared harness (cases.Case, harness.check:
one input generator, the float64 oracle, NaN-poisoned allocations, one metric and the one
tolerance table).

Covered here: varlen with an empty sequence and sequences shorter than a chunk, per-key decays
down to -20 in fp32 (short_strong) and every decay in [-20, -10] in bf16 / fp16
(uniform_strong), no initial state with K != V and weak decays (t63_kv_weak). Interpreted on CPU
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

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from fla_torch.ops.common.engine.dplr_wy import _inv_diag  # noqa: E402

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"

CHUNK = [("chunk_kda", "short_strong", "fp32"), ("chunk_kda", "uniform_strong", "bf16"),
         ("chunk_kda", "t63_kv_weak", "bf16"), ("chunk_rwkv7", "short_strong", "fp32"),
         ("chunk_rwkv7", "uniform_strong", "fp16"), ("chunk_rwkv7", "t63_kv_weak", "fp32")]
# chunk_kda in fp16 under every decay in [-20, -10]: its chunk kernels keep k exp(b), q exp(b)
# and w relative to the chunk's first row there (exp(b) is subnormal in fp16)
CHUNK += [("chunk_kda", "uniform_strong", "fp16")]


@pytest.mark.parametrize("op,case,dtype", CHUNK, ids=["-".join(c) for c in CHUNK])
def test_chunk_dplr_triton(op, case, dtype):
    rows = check(op, case, dtype, {"torch": "triton"}, device=DEVICE)
    bad = [f"{r.compared} {r.tensor} err={r.error:.3e} tol={r.tolerance:.1e}"
           for r in rows if not r.passed]
    assert rows and not bad, "\n".join(bad)



@triton.jit
def _inverse_kernel(A, O):
    o = tl.arange(0, 16)
    p = o[:, None] * 16 + o[None, :]
    tl.store(O + p, _inv_diag(tl.load(A + p)))


@pytest.mark.parametrize("scale", [0.3, 1.0])
def test_dplr_wy_diagonal_inverse(scale):
    """dplr_wy._inv_diag ((I + A)(I + A^2)(I + A^4)(I + A^8) for a strictly lower 16x16 A)
    against the float64 inverse of I - A, random blocks (entries up to ~3 at scale 1.0)."""
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        A = torch.tril(torch.randn(16, 16, generator=g) * scale, -1)
        out = torch.full((16, 16), float("nan"))
        _inverse_kernel[(1,)](A, out)
        ref = torch.linalg.inv(torch.eye(16, dtype=torch.float64) - A.double())
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-6, err
