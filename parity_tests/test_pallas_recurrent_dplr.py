"""Kernel tests of the Pallas fused_recurrent KDA and RWKV-7 ops (the DPLR recurrent driver,
fla_jax/ops/common/pallas_dplr_recurrent.py) on CPU, interpreted: the features test_ops'
kernel subset does not reach, as a case list on the shared harness (cases.Case / make_inputs,
the fp64 oracle of torch_runner, jax_runner under jax.jit with traced cu_seqlens, cases.rel_rms
and THE tolerance table).

Varlen with an empty sequence, a short one and ones spanning two checkpoint chunks (64
tokens); per-channel gates down to -20 in fp32 / bf16 / fp16; K != V without an initial
state; K = V = 256 (value blocks of 16) on a few tokens; output_final_state=False (KDA's
grouped heads + l2norm and gates all in [-20, -10] are test_ops kernel rows). Interpreted
Pallas outputs start NaN-filled, so an unwritten element fails. With a GPU backend the same
cases run the compiled kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from . import jax_runner, torch_runner
from .cases import OPS, Case, make_inputs, op_kwargs, rel_rms, seed_of, tolerance

BOTH = ("kda", "rwkv7")
CASES = (
    Case("dplr_varlen_empty_short", B=1, T=150, cu_seqlens=(0, 0, 5, 70, 150), strength=1.0,
         families=BOTH, dtypes=("fp32",)),
    Case("dplr_strong", B=1, T=100, cu_seqlens=(0, 30, 100), strength=20.0, families=BOTH,
         dtypes=("fp32", "bf16", "fp16")),
    Case("dplr_no_h0_k48_v32", B=2, T=40, K=48, V=32, h0=False, families=BOTH,
         dtypes=("fp32",)),
    Case("dplr_kv256", B=1, T=12, H=1, HV=1, K=256, V=256, families=BOTH,
         dtypes=("fp32",)),
)


def _inputs(op: str, case: Case, dtype: str) -> dict:
    spec = OPS[op]
    raw = make_inputs(spec, case, seed_of("pallas_recurrent_dplr", case.name))
    act = {a.key for a in spec.activations} | {"do"}
    return {n: torch_runner.round_to(dtype if n in act else "fp32", a) for n, a in raw.items()}


def _check(op: str, case: Case, dtype: str) -> None:
    spec = OPS[op]
    x = _inputs(op, case, dtype)
    ref = torch_runner.run(spec, case, "reference", "fp64", x)
    got = jax_runner.run(spec, case, "pallas", dtype, x)
    errs = {t: (rel_rms(got[t], ref[t], ref[t]), tolerance(dtype, t)) for t in ref}
    bad = {t: e for t, e in errs.items() if not e[0] <= e[1]}
    assert not bad, f"{op} {case.name} {dtype}: (error, tolerance) over tolerance {bad}; all {errs}"


def _params():
    for family in BOTH:
        for case in CASES:
            if family in case.families:
                for dtype in case.dtypes:
                    yield pytest.param(f"fused_recurrent_{family}", case, dtype,
                                       id=f"{family}-{case.name}-{dtype}")


@pytest.mark.parametrize("op,case,dtype", list(_params()))
def test_fused_recurrent_dplr(op, case, dtype):
    _check(op, case, dtype)


@pytest.mark.parametrize("op", ["fused_recurrent_kda", "fused_recurrent_rwkv7"])
def test_no_final_state(op):
    """output_final_state=False: final state None, o and every gradient as with a zero
    final-state cotangent (fp32, varlen with an empty sequence)."""
    import fla_jax.ops as ops

    spec = OPS[op]
    case = Case("dplr_no_final_state", B=1, T=80, cu_seqlens=(0, 10, 10, 80), families=BOTH)
    x = _inputs(op, case, "fp32")
    x["dht"] = np.zeros_like(x["dht"])
    ref = torch_runner.run(spec, case, "reference", "fp64", x)
    present = [a for a in spec.args if a.key in x]
    fn = getattr(ops, op)
    cu = jnp.asarray(case.cu_seqlens, jnp.int32)
    static = dict(op_kwargs(spec, case), output_final_state=False)

    @jax.jit
    def run(cu, *args):
        def f(*a):
            kw = {arg.name: t for arg, t in zip(present, a)}
            o, ht = fn(**kw, **static, cu_seqlens=cu, impl="pallas")
            assert ht is None
            return o
        o, vjp = jax.vjp(f, *args)
        return o, vjp(jnp.asarray(x["do"], jnp.float32))

    o, grads = run(cu, *(jnp.asarray(x[a.key], jnp.float32) for a in present))
    got = dict(zip(["d" + a.key for a in present], grads), o=o)
    errs = {t: rel_rms(np.asarray(got[t], np.float64), ref[t], ref[t]) for t in got}
    bad = {t: e for t, e in errs.items() if not e <= tolerance("fp32", t)}
    assert not bad, f"{op} output_final_state=False: over tolerance {bad}; all {errs}"


@pytest.mark.parametrize("op", ["fused_recurrent_kda", "fused_recurrent_rwkv7"])
def test_backward_programs_stride(op, monkeypatch):
    """Fewer backward programs than (sequence, head, value block) items (8 items over 3
    programs, unevenly): each program walks several items and reuses its workspace row."""
    from fla_jax.ops.common import pallas_dplr_recurrent

    monkeypatch.setattr(pallas_dplr_recurrent, "MAX_BWD_PROGRAMS", 3)
    _check(op, CASES[0], "fp32")
