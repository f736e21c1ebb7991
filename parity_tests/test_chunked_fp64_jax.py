"""fla_jax: impl='chunked' and impl='reference' in float64 against the float64 oracle (fla_torch's
reference), outputs, final states and every gradient, as a case list on the shared harness
(cases.FP64_CASES, harness.check, jax_runner in a jax.enable_x64 context, TOLERANCE['fp64'] =
1e-9).

JAX compiles every shape once (about 1-3 s of CPU each), so each case packs many features:
one varlen call holds sequences of length 1, 63, 100 and 130 (T values not multiple of the
chunk), another a zero-length sequence (weak gates, l2norm, no initial state); fixed-length
calls cover the padded batch path (T = 1 with g and g_gamma, T = 130 with beta in (0, 2)).
Also: fused_recurrent_* reaching the same implementations, a perturbed implementation caught,
and float64 staying local to the tests that ask for it.
"""
from __future__ import annotations

import contextlib
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from . import jax_runner
from .cases import CASES, OPS
from .harness import assert_passed, check, inputs

FAMILIES = ("simple_gla", "gla", "delta_rule", "gated_delta_rule")
DELTA = ("delta_rule", "gated_delta_rule")
PACKED = ("f64_varlen_1_63_100_130_strong", "f64_varlen_empty_weak_l2_no_h0",
          "f64_b2_t130_beta2_l2", "f64_b2_t1_both_gates")


def _case(family: str, name: str) -> str:
    """A cases._fp64_pair case for the family (*_gqa for the delta rules)."""
    return f"{name}_gqa" if family in DELTA else name


# (family, case, impl), both impls of a case in a row: they share the cached oracle
CELLS = [(f, _case(f, c)) for c in PACKED for f in FAMILIES]
CELLS += [("simple_gla", c) for c in ("f64_strong_gamma", "f64_no_gate")]
ROWS = [pytest.param(f, c, i, id=f"{f}-{c}-{i}") for f, c in CELLS
        for i in ("chunked", "reference")]


@pytest.mark.parametrize("family,case,impl", ROWS)
def test_matches_oracle_fp64(family, case, impl):
    """Every tensor within 1e-9 of the oracle; with no initial state, a zero-length sequence
    ends with a state of exactly 0."""
    got = {}
    assert_passed(check(f"chunk_{family}", case, "fp64", {"jax": impl}, outputs=got))
    c = CASES[case]
    if c.cu_seqlens is not None and not c.h0:
        empty = [n for n in range(len(c.cu_seqlens) - 1)
                 if c.cu_seqlens[n + 1] == c.cu_seqlens[n]]
        assert not np.any(got["jax"]["ht"][empty])


def test_fused_recurrent_names_share_the_implementations():
    """fused_recurrent_<family>(impl='chunked') gives chunk_<family>'s result to the bit
    (forward, under jit with a traced cu_seqlens)."""
    from fla_jax import ops
    for family in FAMILIES:
        op, case = f"chunk_{family}", _case(family, "f64_varlen")
        spec, c = OPS[op], CASES[case]
        x = inputs(op, case, "fp64")
        names = [a.name for a in spec.args if a.key in x]
        args = [x[a.key] for a in spec.args if a.key in x]
        extra = {"use_qk_l2norm_in_kernel": False} if spec.l2norm else {}

        def both(cu, *xs):
            kw = dict(zip(names, xs), output_final_state=True, impl="chunked", cu_seqlens=cu,
                      **extra)
            return getattr(ops, op)(**kw), getattr(ops, f"fused_recurrent_{family}")(**kw)

        with jax_runner.x64():
            a, b = jax.jit(both)(jnp.asarray(c.cu_seqlens, jnp.int32), *map(jnp.asarray, args))
            a, b = [np.asarray(t) for t in a], [np.asarray(t) for t in b]
        assert a[0].dtype == np.float64
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
    """A chunked implementation with within-chunk decays off by 1e-6 (relative) fails the
    fp64 tolerance on o and the gradients, by over 100x."""
    module = importlib.import_module(
        "fla_jax.ops.simple_gla.chunked" if family == "simple_gla"
        else "fla_jax.ops.common.chunk_delta_wy")
    original = module.pairwise_decay
    with _patched(module, "pairwise_decay",
                  lambda b, inclusive=True: original(b * (1 + 1e-6), inclusive)):
        rows = check(f"chunk_{family}", _case(family, "f64_k48_v32"), "fp64",
                     {"jax": "chunked"})
    errs = {r.tensor: r.error / r.tolerance for r in rows}
    for name in ("o", "dq", "dk", "dv", "dg"):
        assert errs[name] > 100, (name, errs[name])


def test_float64_stays_local():
    """The x64 context of these tests does not leak into the rest of the process."""
    with jax_runner.x64():
        assert jnp.zeros(1, jnp.float64).dtype == np.float64
    assert jnp.asarray(1.0).dtype == np.float32
