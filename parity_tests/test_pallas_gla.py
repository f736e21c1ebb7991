"""Kernel tests of the Pallas GLA ops (chunk_gla on the chunk engine, fused_recurrent_gla) on
CPU, interpreted: the features test_ops' kernel subset does not reach, as a case list on the
shared harness (cases.GLA_KERNEL_CASES, harness.check: the fp64 oracle, jax_runner under
jax.jit with traced cu_seqlens, cases.rel_rms and THE tolerance table). The engine's scalar-gate
wiring (no op entry point of its own) is checked on the same inputs, oracle and metric.

Varlen with an empty and sub-chunk sequences, no initial state, K != V, K = V = 256 and
non-powers of two, per-channel gates down to -20 (fp32 / bf16 / fp16), weak gates (0.01),
output_final_state=False. Interpreted Pallas outputs start NaN-filled, so an unwritten element
fails. With a GPU backend the same cases run the compiled kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from . import jax_runner, torch_runner
from .cases import OPS, Case, interpreted_dtypes, make_inputs, rel_rms, seed_of, tolerance
from .harness import assert_passed, check, check_no_final_state

ALL = ("fp32", "bf16", "fp16")
PALLAS = {"jax": "pallas"}
# (case, dtypes); cases.GLA_KERNEL_CASES
CHUNK = (("pgla_varlen_empty_sub", ("fp32", "bf16")), ("pgla_sub_chunk_only", ("fp32",)),
         ("pgla_no_h0_k48_v32", ("fp32", "fp16")), ("pgla_kv256", ("fp32", "bf16")),
         ("pgla_k100_v48", ("fp32", "bf16")), ("pgla_k16_v100", ("fp32",)),
         ("pgla_k160_v144", ("fp32",)),
         ("pgla_strong_channels", ALL), ("pgla_uniform_strong_long", ALL),
         ("pgla_weak", ("fp32", "bf16")))
# the recurrent kernel runs a Python-level loop per token when interpreted: its shapes stay small
RECURRENT = ("pgla_varlen_empty_sub", "pgla_no_h0_k48_v32", "pgla_k100_v48",
             "pgla_strong_channels", "pgla_weak")


def _params(names=None):
    return [pytest.param(c, d, id=f"{c}-{d}") for i, (c, dts) in enumerate(CHUNK)
            if names is None or c in names for d in interpreted_dtypes(i, dts)]


@pytest.mark.parametrize("case,dtype", _params())
def test_chunk_gla(case, dtype):
    assert_passed(check("chunk_gla", case, dtype, PALLAS))


@pytest.mark.parametrize("case,dtype", _params(RECURRENT))
def test_fused_recurrent_gla(case, dtype):
    assert_passed(check("fused_recurrent_gla", case, dtype, PALLAS))


@pytest.mark.parametrize("op", ["chunk_gla", "fused_recurrent_gla"])
def test_no_final_state(op):
    """output_final_state=False: final state None, o and every gradient as with a zero
    final-state cotangent (fp32, varlen with an empty sequence)."""
    assert_passed(check_no_final_state(op, "gla_no_final_state", "fp32", PALLAS))


ENGINE_CASES = (
    Case("engine_scalar_varlen", B=1, T=150, cu_seqlens=(0, 0, 10, 40, 150), strength=1.0,
         families=("simple_gla",)),
    Case("engine_scalar_uniform_strong", B=1, T=150, cu_seqlens=(0, 60, 150), strength=20.0,
         floor=0.5, families=("simple_gla",)),
    Case("engine_no_gate", B=2, T=100, K=32, V=48, gate_mode="none", strength=0.0,
         families=("simple_gla",)),
)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda c: c.name)
def test_engine_scalar_gate_is_simple_gla(case, dtype):
    """The engine with GATE_SCALAR (g [B, T, H]) / GATE_NONE, wired like chunk_gla_pallas,
    against the float64 chunk_simple_gla oracle: o, final state and every gradient."""
    from fla_jax.ops.common import engine as en

    spec = OPS["chunk_simple_gla"]
    raw = make_inputs(spec, case, seed_of("pallas_engine", case.name))
    act = ("q", "k", "v", "do")
    x = {n: torch_runner.round_to(dtype if n in act else "fp32", a) for n, a in raw.items()}
    ref = torch_runner.run(spec, case, "reference", "fp64", x)
    dt = jax_runner.DTYPES[dtype]
    names = ["q", "k", "v"] + (["g"] if "g" in x else []) + ["h0"]
    gate = en.GATE_SCALAR if "g" in x else en.GATE_NONE
    cu = None if case.cu_seqlens is None else jnp.asarray(case.cu_seqlens, jnp.int32)
    K = case.K

    @jax.jit
    def run(cu, *args):
        def f(*a):
            named = dict(zip(names, a))
            g = named.get("g")
            pb = en.make_problem(named["q"], named["v"], g, named["h0"], cu, K ** -0.5, gate)
            return en.engine_chunk(pb, named["q"], named["k"], named["v"], g, named["h0"], cu)
        (o, ht), vjp = jax.vjp(f, *args)
        return o, ht, vjp((jnp.asarray(x["do"], jnp.float32).astype(dt),
                           jnp.asarray(x["dht"], jnp.float32)))

    args = [jnp.asarray(x[n], jnp.float32).astype(dt if n in "qkv" else jnp.float32)
            for n in names]
    o, ht, grads = run(cu, *args)
    got = {"o": o, "ht": ht}
    got.update({("dh0" if n == "h0" else "d" + n): gr for n, gr in zip(names, grads)})
    assert o.dtype == dt and all(got["d" + n].dtype == dt for n in "qkv")
    errs = {t: rel_rms(np.asarray(jnp.asarray(got[t], jnp.float32), np.float64), ref[t], ref[t])
            for t in got}
    bad = {t: e for t, e in errs.items() if not e <= tolerance(dtype, t)}
    assert not bad, f"engine {case.name} {dtype}: over tolerance {bad}; all {errs}"


@pytest.mark.parametrize("case,dtype", [("pgla_strong_channels", "fp16"),
                                        ("pgla_varlen_empty_sub", "bf16")])
def test_chunk_gla_intra_rows_frame(case, dtype, monkeypatch):
    """The output backward's intra-chunk kernel in its other layout (output_grads.INTRA_FRAME
    'rows': one [16, BT] dot per sub-chunk; the case list above runs the default 'chunk'),
    kept for GPU timing: same oracle and tolerances (traced afresh: jit caches cleared)."""
    from fla_jax.ops.common.engine import output_grads

    assert output_grads.INTRA_FRAME == "chunk"
    traced = []
    rows_kernel = output_grads._intra_kernel

    def counted(*a, **kw):
        traced.append(1)
        return rows_kernel(*a, **kw)

    monkeypatch.setattr(output_grads, "INTRA_FRAME", "rows")
    monkeypatch.setattr(output_grads, "_intra_kernel", counted)
    jax.clear_caches()
    try:
        assert_passed(check("chunk_gla", case, dtype, PALLAS))
    finally:
        jax.clear_caches()
    assert traced, "the 'rows' intra kernel was not traced"
