"""fla_jax: impl='chunked' == impl='reference' in float64, outputs, final states and gradients.

Both implementations run in float64 (inside a `jax.enable_x64` context, so other tests in
the process keep JAX's default settings) on the same random inputs (numpy, seeded, never
zeros). Every tensor -- o, final_state and the gradients of q, k, v, g, g_gamma, beta and
initial_state under random cotangents (jax.vjp) -- must agree to
RMS(chunked - reference) / RMS(reference) < 1e-9. The reference itself is checked against
plain numpy loops. A perturbed implementation must fail the same check.

JAX compiles every shape once (about 1-3 s of CPU each), so each case packs many features:
one varlen call holds sequences of length 1, 63, 100 and 130 (T values not multiple of the
chunk), another holds a zero-length sequence; fixed-length calls cover the padded batch path.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest

import jax  # noqa: E402  (the suite needs every framework: no silent skip)
import jax.numpy as jnp  # noqa: E402

from fla_jax import ops  # noqa: E402

TOL = 1e-9
DELTA = ("delta_rule", "gated_delta_rule")
OPS = {"simple_gla": ops.chunk_simple_gla, "gla": ops.chunk_gla,
       "delta_rule": ops.chunk_delta_rule, "gated_delta_rule": ops.chunk_gated_delta_rule}
RECURRENT_OPS = {"simple_gla": ops.fused_recurrent_simple_gla, "gla": ops.fused_recurrent_gla,
                 "delta_rule": ops.fused_recurrent_delta_rule,
                 "gated_delta_rule": ops.fused_recurrent_gated_delta_rule}


def x64():
    """float64 for the duration of a with-block only."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    return jax.experimental.enable_x64()  # older jax


@dataclass(frozen=True)
class Case:
    """One call: shapes, features and how it is run."""

    name: str
    T: int
    B: int = 1
    H: int = 2
    HV: int = 2            # value heads (delta families: grouped, HV % H == 0)
    K: int = 32
    V: int = 48
    cu_seqlens: Optional[tuple] = None
    gate: float = 1.0      # per-token log-decay in (-1.5 gate, -0.5 gate)
    gate_kind: str = "g"   # simple_gla: "g", "gamma", "g+gamma" or "" (no gate)
    beta_max: float = 1.0
    l2norm: bool = False
    h0: bool = True
    jit: str = "traced"    # "traced": jit, cu_seqlens an argument; "eager": no jit (slow)
    families: tuple = field(default=("simple_gla", "gla", "delta_rule", "gated_delta_rule"))


CASES = [
    # sequences of length 1, 63, 100, 130; strong gates; jit with a traced cu_seqlens
    Case("varlen-T1-63-100-130-strong", T=294, cu_seqlens=(0, 1, 64, 164, 294), gate=10.0,
         HV=4, beta_max=2.0),
    # a zero-length sequence, weak gates, no initial state, l2norm, beta in (0, 1)
    Case("varlen-empty-weak-l2norm", T=300, cu_seqlens=(0, 15, 15, 100, 300), gate=0.01,
         h0=False, l2norm=True, HV=4),
    # fixed-length batch, T = 130 (padded last chunk), K != V, GQA, beta in (0, 2)
    Case("fixed-B2-T130-gqa-beta2", T=130, B=2, HV=4, beta_max=2.0, l2norm=True),
    # fixed-length T = 1 (one padded chunk); simple GLA with g and g_gamma
    Case("fixed-B2-T1-g+gamma", T=1, B=2, HV=4, gate_kind="g+gamma", gate=0.5),
    # simple GLA special forms: fixed decay only (RetNet), strong; no gate (linear attention)
    Case("gamma-strong-T100", T=100, gate_kind="gamma", gate=10.0, families=("simple_gla",)),
    Case("nogate-T63", T=63, gate_kind="", families=("simple_gla",)),
]


def make_inputs(family: str, case: Case, seed: int = 0):
    """Random float64 numpy inputs: (q, k, v, {optional name: array})."""
    rng = np.random.default_rng(seed)
    B, T, H, K, V = case.B, case.T, case.H, case.K, case.V
    HV = case.HV if family in DELTA else H
    N = B if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if family in DELTA and not case.l2norm:
        # rows of norm in (0.3, 1): the delta rule stays contractive for beta in (0, 2)
        k = k / np.linalg.norm(k, axis=-1, keepdims=True) * rng.uniform(0.3, 1, (B, T, H, 1))
    elif family not in DELTA:
        k = k / np.sqrt(K)
    v = rng.standard_normal((B, T, HV, V))
    extra = {}
    if family == "gla":
        extra["g"] = -case.gate * rng.uniform(0.5, 1.5, (B, T, HV, K))
    elif family == "gated_delta_rule" or (family == "simple_gla" and "g" in case.gate_kind.split("+")):
        extra["g"] = -case.gate * rng.uniform(0.5, 1.5, (B, T, HV))
    if family == "simple_gla" and "gamma" in case.gate_kind:
        extra["g_gamma"] = -case.gate * rng.uniform(0.5, 1.5, (HV,))
    if family in DELTA:
        extra["beta"] = case.beta_max * rng.uniform(0.02, 0.98, (B, T, HV))
    if case.h0:
        extra["initial_state"] = rng.standard_normal((N, HV, K, V))
    return q, k, v, extra


def run_with_grads(family: str, impl: str, case: Case, inputs, *, op=None, cot_seed: int = 1):
    """{name: np.ndarray} for o, final_state and every input gradient (jax.vjp with random
    cotangents). Must be called inside x64()."""
    q, k, v, extra = inputs
    names = ["q", "k", "v"] + list(extra)
    arrays = [jnp.asarray(x) for x in (q, k, v, *extra.values())]
    fn = op or OPS[family]
    static = {"scale": None, "output_final_state": True}
    if family in DELTA:
        static["use_qk_l2norm_in_kernel"] = case.l2norm

    def call(cu, *xs):
        kw = dict(zip(names[3:], xs[3:]))
        return fn(*xs[:3], cu_seqlens=cu, impl=impl, **kw, **static)

    cu = None if case.cu_seqlens is None else jnp.asarray(np.array(case.cu_seqlens, np.int32))

    def forward_and_vjp(cu, *xs):
        (o, s), vjp = jax.vjp(lambda *a: call(cu, *a), *xs)
        rng = np.random.default_rng(cot_seed)
        do = jnp.asarray(rng.standard_normal(o.shape))
        ds = jnp.asarray(rng.standard_normal(s.shape))
        return o, s, vjp((do, ds))

    if case.jit == "traced":
        forward_and_vjp = jax.jit(forward_and_vjp)
    o, s, grads = forward_and_vjp(cu, *arrays)
    out = {"o": o, "final_state": s}
    out.update({f"d{n}": gr for n, gr in zip(names, grads)})
    return {n: np.asarray(x) for n, x in out.items()}


def rel_rms(a, ref) -> float:
    """RMS(a - ref) / RMS(ref) (absolute RMS when ref is all zeros)."""
    err = float(np.sqrt(np.mean((np.asarray(a, np.float64) - ref) ** 2)))
    scale = float(np.sqrt(np.mean(np.asarray(ref, np.float64) ** 2)))
    return err / scale if scale > 0 else err


def numpy_recurrence(family: str, case: Case, inputs, scale: float):
    """Plain float64 loops over tokens: (o, final_state), the oracle of the reference."""
    q, k, v, extra = inputs
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    if case.l2norm and family in DELTA:
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    cu = case.cu_seqlens
    segments = ([(b, 0, T) for b in range(B)] if cu is None
                else [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)])
    o = np.zeros((B, T, HV, V))
    finals = []
    for n, (b, start, end) in enumerate(segments):
        S = (extra["initial_state"][n].copy() if "initial_state" in extra
             else np.zeros((HV, K, V)))
        for t in range(start, end):
            for h in range(HV):
                qt, kt = q[b, t, h // G], k[b, t, h // G]
                decay = 0.0
                if "g" in extra:
                    decay = decay + extra["g"][b, t, h]
                if "g_gamma" in extra:
                    decay = decay + extra["g_gamma"][h]
                S[h] *= np.exp(decay)[:, None] if np.ndim(decay) else np.exp(decay)
                if "beta" in extra:
                    S[h] += extra["beta"][b, t, h] * np.outer(kt, v[b, t, h] - kt @ S[h])
                else:
                    S[h] += np.outer(kt, v[b, t, h])
                o[b, t, h] = scale * qt @ S[h]
        finals.append(S)
    return o, np.stack(finals)


PARAMS = [(c, f) for c in CASES for f in c.families]


@pytest.mark.parametrize("case,family", PARAMS, ids=[f"{f}-{c.name}" for c, f in PARAMS])
def test_chunked_matches_reference_fp64(case, family):
    inputs = make_inputs(family, case)
    with x64():
        ref = run_with_grads(family, "reference", case, inputs)
        got = run_with_grads(family, "chunked", case, inputs)
    expected = {"o", "final_state", "dq", "dk", "dv"} | {f"d{n}" for n in inputs[3]}
    assert set(ref) == set(got) == expected
    for name, x in got.items():
        assert x.dtype == ref[name].dtype == np.float64, (name, x.dtype, ref[name].dtype)
        assert x.shape == ref[name].shape, (name, x.shape, ref[name].shape)
        assert np.isfinite(x).all(), name
        assert np.any(ref[name] != 0), f"{name}: reference is all zeros (test cannot fail)"
    errs = {n: rel_rms(got[n], ref[n]) for n in ref}
    bad = {n: e for n, e in errs.items() if not e < TOL}
    assert not bad, f"chunked vs reference rel RMS above {TOL}: {bad}"

    # the reference itself against plain numpy loops (forward and final state)
    o_np, s_np = numpy_recurrence(family, case, inputs, case.K ** -0.5)
    assert rel_rms(ref["o"], o_np) < TOL, rel_rms(ref["o"], o_np)
    assert rel_rms(ref["final_state"], s_np) < TOL, rel_rms(ref["final_state"], s_np)
    if case.cu_seqlens is not None and not case.h0:
        for n in range(len(case.cu_seqlens) - 1):   # zero-length sequence: state stays 0
            if case.cu_seqlens[n + 1] == case.cu_seqlens[n]:
                assert not np.any(got["final_state"][n])


def test_fused_recurrent_names_share_the_implementations():
    """fused_recurrent_<family>(impl='chunked') gives chunk_<family>'s result (forward,
    under jit with a traced cu_seqlens)."""
    case = Case("recurrent-names", T=20, HV=4, cu_seqlens=(0, 5, 20))
    for family in OPS:
        q, k, v, extra = make_inputs(family, case)
        names = list(extra)

        def both(cu, q, k, v, *xs):
            kw = dict(zip(names, xs), output_final_state=True, impl="chunked", cu_seqlens=cu)
            return OPS[family](q, k, v, **kw), RECURRENT_OPS[family](q, k, v, **kw)

        with x64():
            (a, b) = jax.jit(both)(jnp.asarray(case.cu_seqlens), *map(jnp.asarray, (q, k, v)),
                                   *map(jnp.asarray, extra.values()))
            a, b = [np.asarray(x) for x in a], [np.asarray(x) for x in b]
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


@contextlib.contextmanager
def _patched(module, name, replacement):
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield original
    finally:
        setattr(module, name, original)


@pytest.mark.parametrize("family", ["simple_gla", "gated_delta_rule"])
def test_perturbed_implementation_is_caught(family):
    """A chunked implementation with within-chunk decays off by 1e-6 (relative) must fail
    the tolerance on o, final_state and the gradients."""
    import importlib
    module = importlib.import_module(
        "fla_jax.ops.simple_gla.chunked" if family == "simple_gla"
        else "fla_jax.ops.common.chunk_delta_wy")
    original = module.pairwise_decay
    case = Case("perturbed", T=70, HV=4, gate=1.0)
    inputs = make_inputs(family, case)
    with x64(), _patched(module, "pairwise_decay",
                         lambda b, inclusive=True: original(b * (1 + 1e-6), inclusive)):
        ref = run_with_grads(family, "reference", case, inputs)
        got = run_with_grads(family, "chunked", case, inputs)
    errs = {n: rel_rms(got[n], ref[n]) for n in ref}
    for name in ("o", "dq", "dk", "dv", "dg"):
        assert errs[name] > 100 * TOL, (name, errs[name])


def test_float64_stays_local():
    """The x64 context of these tests does not leak into the rest of the process."""
    with x64():
        assert jnp.zeros(1, jnp.float64).dtype == np.float64
    assert jnp.asarray(1.0).dtype == np.float32
