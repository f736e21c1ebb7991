"""Triton fused_recurrent KDA and RWKV-7 kernels (forward and backward): the cases that
test_ops.py's CPU kernel subset leaves out, on the shared harness (cases.Case, harness.check:
one input generator, the float64 oracle, NaN-poisoned allocations, one metric and the one
tolerance table).

Covered here (cases.DPLR_KERNEL_CASES): varlen with an empty sequence, short ones and one that
crosses a state checkpoint of the backward; no initial state with K != V (V tiled over two
programs, masked); per-channel gates in [-20, -1] in fp32 / bf16 / fp16; K = V = 256; a decode
step (T = 1) chained through the final state; no final state. Interpreted on CPU
(TRITON_INTERPRET=1, set by conftest) or on a GPU with PARITY_DEVICE=cuda.
"""
from __future__ import annotations

import os

if os.environ.get("PARITY_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402,F401  (the suite needs every framework: no silent skip)

from parity_tests import triton_interpret_patch  # noqa: E402
from parity_tests.cases import CASES, OPS, op_kwargs, rel_rms, tolerance  # noqa: E402
from parity_tests.harness import (assert_passed, check, check_no_final_state,  # noqa: E402
                                  inputs)

triton_interpret_patch.apply()

DEVICE = "cuda" if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" else "cpu"

ROWS = [
    ("fused_recurrent_kda", "dplr_varlen_kv", "bf16"),
    ("fused_recurrent_rwkv7", "dplr_varlen_kv", "fp32"),
    ("fused_recurrent_rwkv7", "dplr_strong", "fp32"),
    ("fused_recurrent_kda", "dplr_strong", "fp32"),
    ("fused_recurrent_kda", "dplr_strong", "fp16"),
    ("fused_recurrent_rwkv7", "dplr_strong", "bf16"),
    ("fused_recurrent_kda", "dplr_k256", "bf16"),
    ("fused_recurrent_rwkv7", "dplr_k256", "fp32"),
]


@pytest.mark.parametrize("op,case,dtype", ROWS, ids=["-".join(r) for r in ROWS])
def test_fused_recurrent_dplr_triton(op, case, dtype):
    rows = check(op, case, dtype, {"torch": "triton"}, device=DEVICE)
    bad = [f"{r.compared} {r.tensor} err={r.error:.3e} tol={r.tolerance:.1e}"
           for r in rows if not r.passed]
    assert rows and not bad, "\n".join(bad)


@pytest.mark.parametrize("op", ["fused_recurrent_rwkv7", "fused_recurrent_kda"])
def test_decode_steps_match_one_call(op):
    """Token-by-token calls chained through the final state equal one call (fp32)."""
    import fla_torch.ops as ops
    spec, case = OPS[op], CASES["dplr_decode"]
    x = inputs(op, case.name, "fp32")
    t = {a.name: torch.tensor(x[a.key], dtype=torch.float32, device=DEVICE)
         for a in spec.args if a.key in x}
    h0 = t.pop("initial_state")
    kw = op_kwargs(spec, case)

    def call(s, e, h):
        return getattr(ops, op)(**{n: a[:, s:e] for n, a in t.items()}, initial_state=h, **kw,
                                impl="triton")

    o_all, h_all = call(0, case.T, h0)
    h, outs = h0, []
    for step in range(case.T):
        o_t, h = call(step, step + 1, h)
        outs.append(o_t)
    for name, a, ref in (("o", torch.cat(outs, 1), o_all), ("ht", h, h_all)):
        a, ref = a.double().cpu().numpy(), ref.double().cpu().numpy()
        err = rel_rms(a, ref, ref)
        assert err <= tolerance("fp32", name), f"{op} {name}: {err:.3e}"


def test_no_final_state_bf16():
    """output_final_state=False (bf16): no final state, o and every gradient as the oracle's
    with a zero final-state cotangent."""
    rows = check_no_final_state("fused_recurrent_rwkv7", "dplr_no_final_state", "bf16",
                                {"torch": "triton"}, device=DEVICE)
    assert_passed(rows)
