"""Triton GLA kernels (chunk_gla on the chunk engine, fused_recurrent_gla): the cases that
test_ops.py's CPU kernel subset leaves out, on the shared harness (cases.Case, harness.check:
one input generator, the float64 oracle, NaN-poisoned allocations, one metric and the one
tolerance table).

Covered here: varlen with an empty sequence and sequences shorter than a chunk, no initial
state, K != V, K = V = 256, a non-power-of-two head size (100), per-channel gates down to -20
(uniformly strong: every gate in [-20, -10]) in fp32 / bf16 / fp16, weak gates (0.01), and
output_final_state=False. Interpreted on CPU (TRITON_INTERPRET=1, set by conftest) or on a GPU
with PARITY_DEVICE=cuda.
"""
from __future__ import annotations

import os

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402,F401  (the suite needs every framework: no silent skip)

from parity_tests import triton_interpret_patch  # noqa: E402
from parity_tests.harness import check, check_no_final_state  # noqa: E402

triton_interpret_patch.apply()

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"

# (op, case, dtype): the cases above plus cases.py cases in dtypes test_ops.py's kernel subset
# does not run (t63_kv_weak: no h0, K=32 != V=48, gates of 0.01; uniform_strong: every gate in
# [-20, -10]; short_strong in fp32).
CHUNK = [
    ("tgla_varlen_short", "bf16"),
    ("tgla_k100", "fp32"), ("tgla_k100", "bf16"),
    ("tgla_k256", "bf16"),
    ("tgla_k16_v256", "fp16"), ("tgla_k256_v48", "fp32"),
    ("tgla_strong_long", "fp32"), ("tgla_strong_long", "bf16"), ("tgla_strong_long", "fp16"),
    ("t63_kv_weak", "fp32"), ("t63_kv_weak", "bf16"),
    ("uniform_strong", "bf16"), ("uniform_strong", "fp16"),
    ("short_strong", "fp32"),
]
RECURRENT = [
    ("tgla_varlen_short", "bf16"), ("tgla_k100", "fp32"), ("tgla_k16_v256", "fp16"),
    ("tgla_strong_long", "fp32"), ("tgla_strong_long", "fp16"), ("t63_kv_weak", "fp32"),
    ("uniform_strong", "fp16"), ("short_strong", "fp32"),
]


def _assert_rows(rows):
    bad = [f"{r.compared} {r.tensor} err={r.error:.3e} tol={r.tolerance:.1e}"
           for r in rows if not r.passed]
    assert rows and not bad, "\n".join(bad)


@pytest.mark.parametrize("case,dtype", CHUNK, ids=[f"{c}-{d}" for c, d in CHUNK])
def test_chunk_gla_triton(case, dtype):
    _assert_rows(check("chunk_gla", case, dtype, {"torch": "triton"}, device=DEVICE))


@pytest.mark.parametrize("case,dtype", RECURRENT, ids=[f"{c}-{d}" for c, d in RECURRENT])
def test_fused_recurrent_gla_triton(case, dtype):
    _assert_rows(check("fused_recurrent_gla", case, dtype, {"torch": "triton"}, device=DEVICE))


@pytest.mark.parametrize("op", ["chunk_gla", "fused_recurrent_gla"])
def test_no_final_state(op):
    """output_final_state=False (bf16): no final state, o and every gradient as the oracle's
    with a zero final-state cotangent."""
    _assert_rows(check_no_final_state(op, "gla_no_final_state", "bf16", {"torch": "triton"},
                                      device=DEVICE))


def test_head_dim_limit_is_named():
    from fla_torch.ops.gla.triton_chunk import chunk_gla_triton
    from fla_torch.ops.gla.triton_recurrent import fused_recurrent_gla_triton
    q = torch.zeros(1, 4, 1, 300)
    v = torch.zeros(1, 4, 1, 16)
    for fn in (chunk_gla_triton, fused_recurrent_gla_triton):
        with pytest.raises(ValueError, match="K=300"):
            fn(q, q, v, g=torch.zeros(1, 4, 1, 300), scale=1.0)
