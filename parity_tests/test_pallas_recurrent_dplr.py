"""Kernel tests of the Pallas fused_recurrent KDA and RWKV-7 ops (the DPLR recurrent driver,
fla_jax/ops/common/pallas_dplr_recurrent.py) on CPU, interpreted: the features test_ops'
kernel subset does not reach, as a case list on the shared harness (cases.PALLAS_DPLR_CASES,
harness.check: the fp64 oracle, jax_runner under jax.jit with traced cu_seqlens, cases.rel_rms
and THE tolerance table).

Varlen with an empty sequence, a short one and ones spanning two checkpoint chunks (64
tokens); per-channel gates down to -20 in fp32 / bf16 / fp16; K != V without an initial
state; K = V = 256 (value blocks of 16) on a few tokens; output_final_state=False (KDA's
grouped heads + l2norm and gates all in [-20, -10] are test_ops kernel rows). Interpreted
Pallas outputs start NaN-filled, so an unwritten element fails. With a GPU backend the same
cases run the compiled kernels.
"""
from __future__ import annotations

import pytest

from .harness import assert_passed, check, check_no_final_state

PALLAS = {"jax": "pallas"}
# (case, dtypes) for both fused_recurrent_kda and fused_recurrent_rwkv7
CASES = (("pdplr_varlen_empty_short", ("fp32",)), ("pdplr_strong", ("fp32", "bf16", "fp16")),
         ("pdplr_no_h0_k48_v32", ("fp32",)), ("pdplr_kv256", ("fp32",)))
ROWS = [pytest.param(f"fused_recurrent_{f}", c, d, id=f"{f}-{c}-{d}")
        for f in ("kda", "rwkv7") for c, dts in CASES for d in dts]


@pytest.mark.parametrize("op,case,dtype", ROWS)
def test_fused_recurrent_dplr(op, case, dtype):
    assert_passed(check(op, case, dtype, PALLAS))


@pytest.mark.parametrize("op", ["fused_recurrent_kda", "fused_recurrent_rwkv7"])
def test_no_final_state(op):
    """output_final_state=False: final state None, o and every gradient as with a zero
    final-state cotangent (fp32, varlen with an empty sequence)."""
    assert_passed(check_no_final_state(op, "pdplr_no_final_state", "fp32", PALLAS))


@pytest.mark.parametrize("op", ["fused_recurrent_kda", "fused_recurrent_rwkv7"])
def test_backward_programs_stride(op, monkeypatch):
    """Fewer backward programs than (sequence, head, value block) items (8 items over 3
    programs, unevenly): each program walks several items and reuses its workspace row."""
    from fla_jax.ops.common import pallas_dplr_recurrent

    monkeypatch.setattr(pallas_dplr_recurrent, "MAX_BWD_PROGRAMS", 3)
    assert_passed(check(op, "pdplr_varlen_empty_short", "fp32", PALLAS))
