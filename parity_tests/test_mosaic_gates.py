"""The delta family's gate vectors and beta rows from one kernel (fla_jax/ops/gated_delta_rule/
mosaic_gates.py, Pallas Triton lowering) against float64 and against the XLA formulation it
replaces (GATES = "xla"): interpreted on CPU; lowered for CUDA; the fallback where the kernel
does not apply; named errors."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fla_jax.ops.common.mosaic import export_for_cuda
from fla_jax.ops.gated_delta_rule import mosaic_gates
from fla_jax.ops.gated_delta_rule.mosaic_gates import gate_inputs

C = 64


def _reference(g, b):
    """float64 G, G_last - G (log2 units), beta^T, each [HV, R]."""
    R, HV = b.shape
    x = np.asarray(g, np.float64).T.reshape(HV, R // C, C)
    G = np.cumsum(x, -1)
    later = G[..., -1:] - G
    return (G * math.log2(math.e)).reshape(HV, R), (later * math.log2(math.e)).reshape(HV, R), \
        np.asarray(b, np.float64).T


@pytest.mark.parametrize("HV,strong", [(16, False), (4, True), (1, False), (6, False)])
def test_gate_rows_against_float64_and_xla(HV, strong, monkeypatch):
    """Three chunks: G and G_last - G within fp32 cumsum rounding of float64 (relative to the
    chunk's total; strong gates: -20 per token), beta^T exact, zero rows of later at each
    chunk's end exactly; the XLA formulation agrees to the same bound. HV = 6: the XLA
    fallback (not a power of two)."""
    rng = np.random.default_rng(HV)
    R = 3 * C
    lo = 20.0 if strong else 1.0
    g = jnp.asarray(-rng.uniform(0.0, lo, (R, HV)), jnp.float32)
    b = jnp.asarray(rng.uniform(0.0, 2.0, (R, HV)), jnp.float32)
    assert mosaic_gates.kernel_applies(HV) == (HV != 6)
    got = [np.asarray(x, np.float64) for x in jax.jit(gate_inputs)(g, b)]
    monkeypatch.setattr(mosaic_gates, "GATES", "xla")
    xla = [np.asarray(x, np.float64) for x in jax.jit(gate_inputs)(g, b)]
    want = _reference(g, b)
    tol = 4e-7 * lo * C * 1.5
    for name, a, x, w in zip(("G", "later", "beta_t"), got, xla, want):
        assert a.shape == w.shape == (HV, R), (name, a.shape)
        assert np.max(np.abs(a - w)) <= tol, (name, np.max(np.abs(a - w)), tol)
        assert np.max(np.abs(x - w)) <= tol, (name, "xla", np.max(np.abs(x - w)))
    assert np.array_equal(got[2], want[2])
    assert np.all(got[1].reshape(HV, R // C, C)[..., -1] == 0.0)


def test_ungated_rows():
    """g None (the delta rule): G and later zero, beta^T exact."""
    rng = np.random.default_rng(0)
    b = jnp.asarray(rng.uniform(0.0, 2.0, (2 * C, 8)), jnp.float32)
    G, later, bt = jax.jit(lambda b: gate_inputs(None, b))(b)
    assert np.all(np.asarray(G) == 0.0) and np.all(np.asarray(later) == 0.0)
    assert np.array_equal(np.asarray(bt), np.asarray(b).T)


@pytest.mark.parametrize("gated", [True, False])
def test_gate_rows_kernel_lowers(gated):
    S = jax.ShapeDtypeStruct((4 * C, 16), jnp.float32)
    fn = (lambda g, b: gate_inputs(g, b)) if gated else (lambda b: gate_inputs(None, b))
    text = export_for_cuda(fn, *((S, S) if gated else (S,)))
    assert "gdn_gate_rows" in text or "triton" in text.lower()


def test_gate_rows_named_errors(monkeypatch):
    b = jnp.zeros((C, 4), jnp.float32)
    with pytest.raises(ValueError, match="gate_inputs: beta_rows"):
        gate_inputs(None, b.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="g_rows"):
        gate_inputs(jnp.zeros((C, 2), jnp.float32), b)
    with pytest.raises(ValueError, match="R % 64"):
        gate_inputs(None, jnp.zeros((C + 1, 4), jnp.float32))
    monkeypatch.setattr(mosaic_gates, "GATES", "triton")
    with pytest.raises(ValueError, match="GATES='triton'"):
        gate_inputs(None, b)
