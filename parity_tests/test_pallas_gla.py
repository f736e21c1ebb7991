"""Kernel tests of the Pallas GLA ops (chunk_gla on the chunk engine, fused_recurrent_gla) on
CPU, interpreted: the features test_ops' kernel subset does not reach, as a case list on the
shared harness (cases.Case / make_inputs, the fp64 oracle of torch_runner, jax_runner under
jax.jit with traced cu_seqlens, cases.rel_rms and THE tolerance table).

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
from .cases import OPS, Case, make_inputs, rel_rms, seed_of, tolerance
from .harness import assert_passed, check_no_final_state

GLA = ("gla",)
ALL = ("fp32", "bf16", "fp16")
CASES = (
    Case("varlen_empty_sub", B=1, T=150, cu_seqlens=(0, 0, 10, 40, 150), strength=1.0,
         families=GLA, dtypes=("fp32", "bf16")),
    Case("sub_chunk_only", B=1, T=30, cu_seqlens=(0, 7, 7, 23, 30), strength=2.0, families=GLA,
         dtypes=("fp32",)),
    Case("no_h0_k48_v32", B=2, T=80, K=48, V=32, h0=False, families=GLA, dtypes=("fp32", "fp16")),
    Case("kv256", B=1, T=40, H=1, HV=1, K=256, V=256, families=GLA, dtypes=("fp32", "bf16")),
    Case("k100_v48", B=1, T=70, H=1, HV=1, K=100, V=48, cu_seqlens=(0, 64, 70), families=GLA,
         dtypes=("fp32", "bf16")),
    Case("k16_v100", B=1, T=50, H=1, HV=1, K=16, V=100, families=GLA, dtypes=("fp32",)),
    Case("strong_channels", B=1, T=130, cu_seqlens=(0, 50, 130), strength=20.0, families=GLA,
         dtypes=ALL),
    Case("uniform_strong_long", B=1, T=256, cu_seqlens=(0, 60, 256), strength=20.0, floor=0.5,
         families=GLA, dtypes=ALL),
    Case("weak", B=1, T=100, strength=0.01, families=GLA, dtypes=("fp32", "bf16")),
)
# the recurrent kernel runs a Python-level loop per token when interpreted: its shapes stay small
RECURRENT = ("varlen_empty_sub", "no_h0_k48_v32", "k100_v48", "strong_channels", "weak")


def _inputs(case: Case, dtype: str) -> dict:
    raw = make_inputs(OPS["chunk_gla"], case, seed_of("pallas_gla", case.name))
    act = ("q", "k", "v", "do")
    return {n: torch_runner.round_to(dtype if n in act else "fp32", a) for n, a in raw.items()}


def _check(op: str, case: Case, dtype: str) -> None:
    spec = OPS[op]
    x = _inputs(case, dtype)
    ref = torch_runner.run(spec, case, "reference", "fp64", x)
    got = jax_runner.run(spec, case, "pallas", dtype, x)
    errs = {t: (rel_rms(got[t], ref[t], ref[t]), tolerance(dtype, t)) for t in ref}
    bad = {t: e for t, e in errs.items() if not e[0] <= e[1]}
    assert not bad, f"{op} {case.name} {dtype}: (error, tolerance) over tolerance {bad}; all {errs}"


def _params(names=None):
    for case in CASES:
        if names is None or case.name in names:
            for dtype in case.dtypes:
                yield pytest.param(case, dtype, id=f"{case.name}-{dtype}")


@pytest.mark.parametrize("case,dtype", list(_params()))
def test_chunk_gla(case, dtype):
    _check("chunk_gla", case, dtype)


@pytest.mark.parametrize("case,dtype", list(_params(RECURRENT)))
def test_fused_recurrent_gla(case, dtype):
    _check("fused_recurrent_gla", case, dtype)


@pytest.mark.parametrize("op", ["chunk_gla", "fused_recurrent_gla"])
def test_no_final_state(op):
    """output_final_state=False: final state None, o and every gradient as with a zero
    final-state cotangent (fp32, varlen with an empty sequence)."""
    assert_passed(check_no_final_state(op, "gla_no_final_state", "fp32", {"jax": "pallas"}))


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
