"""Triton delta-rule kernels (chunk / fused_recurrent of delta_rule and gated_delta_rule): the
cases that test_ops.py's CPU kernel subset leaves out, as a case list on the shared harness
(cases.Case / make_inputs, harness.check: the float64 oracle, NaN-poisoned allocations,
cases.rel_rms and the one tolerance table).

Covered here: grouped value heads with K != V, wide heads (K = 144, V = 130: several K / V
tiles, a 6-token last chunk), varlen with an empty sequence, l2-normalised q / k or not, beta in
(0, 2), near 0 and near 1, no initial state, fp32 dg under gates in [-20, -1] and [-20, -10]
over several chunks, fp16 dh0 with every gate in [-20, -10], and output_final_state=False.
Interpreted on CPU (TRITON_INTERPRET=1, set by conftest or here) or on a GPU with
PARITY_DEVICE=cuda.
"""
from __future__ import annotations

import os

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import triton  # noqa: E402,F401  (the suite needs every framework: no silent skip)

from parity_tests import triton_interpret_patch  # noqa: E402
from parity_tests.harness import assert_passed, check, check_no_final_state  # noqa: E402

triton_interpret_patch.apply()

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"
ALL = ("fp32", "bf16", "fp16")
TRITON = {"torch": "triton"}


def _rows(op, *entries):
    """op, (case, dtypes)... -> pytest params (op, case, dtype)"""
    return [pytest.param(op, c, d, id=f"{op}-{c}-{d}") for c, dts in entries for d in dts]


ROWS = (
    _rows("chunk_gated_delta_rule",
          ("dr_gqa_kv", ALL), ("dr_varlen_l2", ("fp32",)), ("dr_strong_tiny_beta", ("fp32",)),
          ("dr_wide", ("fp32", "bf16")), ("dr_strong_long_beta1", ("fp32",)),
          ("dr_uniform_strong_long", ("fp32",)), ("dr_uniform_strong_k64", ("fp16",)))
    + _rows("fused_recurrent_gated_delta_rule",
            ("dr_gqa_kv_rec", ALL), ("dr_varlen_l2", ("fp32",)),
            ("dr_strong_tiny_beta", ("fp32",)), ("dr_strong_long_beta1", ("fp32",)))
    + _rows("chunk_delta_rule",
            ("dr_l2_beta2", ("fp32", "bf16")), ("dr_gqa_no_l2", ("bf16",)),
            ("dr_k24_beta1", ("fp16",)))
    + _rows("fused_recurrent_delta_rule",
            ("dr_l2_beta2_rec", ("fp32", "bf16")), ("dr_gqa_no_l2", ("bf16",)),
            ("dr_k24_beta1", ("fp16",)))
)


@pytest.mark.parametrize("op,case,dtype", ROWS)
def test_delta_triton(op, case, dtype):
    assert_passed(check(op, case, dtype, TRITON, device=DEVICE))


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_no_final_state(op):
    """output_final_state=False (gates to -20, beta < 1e-3, no h0): no final state, o and every
    gradient as the oracle's with a zero final-state cotangent."""
    assert_passed(check_no_final_state(op, "dr_strong_tiny_beta", "fp32", TRITON, device=DEVICE))
