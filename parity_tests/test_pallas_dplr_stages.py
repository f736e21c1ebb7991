"""The Pallas DPLR WY and output stages (engine/dplr_wy.py, engine/dplr_output.py) on CPU,
interpreted, forward and vector-Jacobian product against float64 numpy, with head sizes that
take several column blocks (K = 128, V = 256: two / four blocks of 64) and one that takes one.
The whole pipeline is checked by test_pallas_dplr.py; this file reaches the block loops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fla_jax.ops.common import pallas_triton as ptr
from fla_jax.ops.common.engine.dplr_output import dplr_output
from fla_jax.ops.common.engine.dplr_wy import dplr_wy

P = lax.Precision.HIGHEST
BT = 64
TOL = 2e-6
# ptr.SPLIT3 (16-bit problems): three bf16 products, ~2^-16 relative per term
# ptr.BF16 (a bf16 problem's products): operands rounded to bf16, ~2^-8 relative per term
PRECS = [pytest.param(P, 2e-6, id="fp32"), pytest.param(ptr.SPLIT3, 5e-5, id="split3"),
         pytest.param(ptr.BF16, 1e-2, id="bf16")]


def _tm(x):
    """head-major [S, H, BT, D] <-> token-major [S, BT, H, D] (v, o and their gradients)."""
    return np.swapaxes(np.asarray(x), 1, 2)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _draw(rng, *shape, scale=0.3):
    return rng.standard_normal(shape) * scale


@pytest.mark.parametrize("prec,tol", PRECS)
@pytest.mark.parametrize("K,V", [(32, 16), (128, 256)])
def test_wy_stage(K, V, prec, tol):
    rng = np.random.default_rng(K + V)
    S, H = 2, 2
    A_ab = np.tril(_draw(rng, S, H, BT, BT, scale=0.15), -1)
    A_ak = np.tril(_draw(rng, S, H, BT, BT), -1)
    v, a_in = _draw(rng, S, H, BT, V), _draw(rng, S, H, BT, K)
    du, dw = _draw(rng, S, H, BT, V), _draw(rng, S, H, BT, K)
    # above-diagonal noise in A_ab must be ignored
    noisy = A_ab + np.triu(_draw(rng, S, H, BT, BT), 0)
    T = np.linalg.inv(np.eye(BT) - A_ab)
    X = A_ak @ v
    u_ref, w_ref = T @ X, T @ a_in
    Tt = np.swapaxes(T, -1, -2)
    dX = Tt @ du
    dT = du @ np.swapaxes(X, -1, -2) + dw @ np.swapaxes(a_in, -1, -2)
    ref = {"u": u_ref, "w": w_ref,
           "dA_ab": np.tril(Tt @ dT @ Tt, -1), "dA_ak": dX @ np.swapaxes(v, -1, -2),
           "dv": np.swapaxes(A_ak, -1, -2) @ dX, "da_in": Tt @ dw}
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    (u, w), vjp = jax.vjp(lambda *x: dplr_wy(*x, prec),
                          *map(f32, (noisy, A_ak, _tm(v), a_in)))
    got = dict(zip(("dA_ab", "dA_ak", "dv", "da_in"), vjp((f32(du), f32(dw)))))
    got.update(u=u, w=w, dv=_tm(got["dv"]))
    got["dA_ab"] = np.tril(np.asarray(got["dA_ab"]), -1)
    errs = {n: _rel(got[n], ref[n]) for n in ref}
    assert all(e < tol for e in errs.values()), errs


@pytest.mark.parametrize("prec,tol", PRECS)
@pytest.mark.parametrize("K,V", [(32, 16), (128, 256)])
def test_output_stage(K, V, prec, tol):
    rng = np.random.default_rng(3 * K + V)
    S, H, scale = 2, 2, 0.7
    r_in, S_in = _draw(rng, S, H, BT, K), _draw(rng, S, H, K, V)
    A_rb, U = np.tril(_draw(rng, S, H, BT, BT)), _draw(rng, S, H, BT, V)
    A_rk, v = np.tril(_draw(rng, S, H, BT, BT)), _draw(rng, S, H, BT, V)
    do = _draw(rng, S, H, BT, V)
    t = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    dd = scale * do
    ref = {"o": scale * (r_in @ S_in + A_rb @ U + A_rk @ v),
           "dr_in": dd @ t(S_in), "dS_in": t(r_in) @ dd, "dA_rb": dd @ t(U),
           "dU": t(A_rb) @ dd, "dA_rk": dd @ t(v), "dv": t(A_rk) @ dd}
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    args = tuple(map(f32, (r_in, S_in, A_rb, U, A_rk, _tm(v))))
    o, vjp = jax.vjp(lambda *x: dplr_output(*x, scale, prec), *args)
    got = dict(zip(("dr_in", "dS_in", "dA_rb", "dU", "dA_rk", "dv"), vjp(f32(_tm(do)))))
    got.update(o=_tm(o), dv=_tm(got["dv"]))
    errs = {n: _rel(got[n], ref[n]) for n in ref}
    assert all(e < tol for e in errs.values()), errs


def test_scores_split_diagonal_matches_loop(monkeypatch):
    """dplr_scores with DIAG 'split' (factored diagonal dots + the fix kernels) equals DIAG
    'loop' (exact pairs) forward and backward, with one key block past gates.SPAN (gates to
    -20 in columns 0..31) and one within it (columns 32..63, weak)."""
    import fla_jax.ops.common.engine.dplr_scores as ds
    rng = np.random.default_rng(7)
    S, H, Kp = 1, 2, 64
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    r, k, a, b = (f32(_draw(rng, S, BT, H, Kp, scale=0.5)) for _ in range(4))  # token-major
    strength = np.where(np.arange(Kp) < 32, 20.0, 0.6)
    w = f32(-rng.random((S, BT, H, Kp)) * strength)
    outs = {}
    for diag in ("loop", "split"):
        monkeypatch.setattr(ds, "DIAG", diag)
        y, vjp = jax.vjp(lambda *x: ds.dplr_scores(*x, P), r, k, a, b, w)
        if diag == "loop":
            cts = tuple(f32(_draw(rng, *t.shape)) for t in y)
        outs[diag] = list(y) + list(vjp(cts))
    errs = [_rel(p, q) for p, q in zip(outs["split"], outs["loop"])]
    assert max(errs) < TOL, errs
    monkeypatch.setattr(ds, "DIAG", "nope")
    with pytest.raises(ValueError, match="DIAG"):
        ds.dplr_scores(r, k, a, b, w, P)
