"""Shared pieces of the Pallas score-stage tests (test_pallas_cumsum_scores,
test_pallas_delta_scores): dtypes, the per-element bounds, inputs, a jitted stage runner with
traced cu_seqlens, and the bounded comparison against a float64 numpy reference.

Per element, |got - ref| <= rtol * scale + atol, scale the float64 sum of the absolute terms of
a score (|ref| for the vectors), so tiny decayed entries are held to the same relative accuracy
as O(1) ones (fp32), up to the 16-bit rounding floor.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax.ops.common.engine import GATE_KEY, make_problem
from fla_jax.ops.common.engine import varlen as vl

BT = 64
DT = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# (rtol, atol) per output kind ("A": scores, "x": vectors) and dtype
TOL = {
    "fp32": {"A": (1e-5, 1e-30), "x": (2e-5, 1e-37)},
    "bf16": {"A": (1e-2, 1e-30), "x": (5e-3, 1e-37)},
    "fp16": {"A": (3e-3, 1e-5), "x": (1e-3, 4e-8)},
}


def inputs(dtype, B, T, H, K, gates, seed):
    """q, k [B, T, H, K] rounded to `dtype` (k scaled by 1 / sqrt(K)) and the fp32 key gate
    gates(rng, (B, T, H, K))."""
    rng = np.random.default_rng(seed)
    dt = DT[dtype]
    q = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32).astype(dt)
    k = jnp.asarray(rng.standard_normal((B, T, H, K)) / np.sqrt(K), jnp.float32).astype(dt)
    g = jnp.asarray(gates(rng, (B, T, H, K)), jnp.float32)
    return q, k, g


def run_stage(stage, q, k, g, cu, **kw):
    """stage(pb, q, k, g, cu, seq, **kw) under jax.jit (cu_seqlens traced; None: no varlen)."""
    pb = make_problem(q, q, g, None, None if cu is None else jnp.asarray(cu), 1.0, GATE_KEY)
    cuj = None if cu is None else jnp.asarray(cu, jnp.int32)

    @jax.jit
    def f(q, k, g, cuj):
        seq = None if cuj is None else vl.slot_sequences(cuj, pb.T, pb.bt)
        return stage(pb, q, k, g, cuj, seq, **kw)

    return f(q, k, g, cuj)


def bounded_mismatch(x, want, scale, tol, skip_undefined=False):
    """None when every element of x is within tol[0] * scale + tol[1] of the float64 `want`,
    else (bad element count, worst |err| / bound). Non-finite x always fails;
    skip_undefined: elements where `want` is NaN (nothing defined there) are not compared."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    bound = tol[0] * scale + tol[1]
    err = np.where(np.isfinite(x), np.abs(x - want), np.inf)
    ratio = err / bound
    bad = ~(ratio <= 1.0)
    if skip_undefined:
        defined = ~np.isnan(want)
        bad &= defined
        ratio = np.where(defined, ratio, 0.0)
    if bad.any():
        return int(bad.sum()), float(np.nanmax(ratio))
    return None
