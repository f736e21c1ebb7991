"""Token-by-token Gated Slot Attention as Pallas kernels: GLA's recurrent kernels
(fla_jax/ops/gla/pallas_recurrent.py) composed as in gsa/pallas_chunk.py.

The value pass is recurrent GLA (q = softmax(ok), k = s, v, gate g, scale 1). The slot pass
(gate on the slot side) is the adjoint of recurrent GLA F with keys s, values k, states hk^T:
ok = dQ of F for the cotangent q; its backward is F forward (dq = o of F(Q = dok)) and F
backward with cotangent q ((ds, dk, dg, dhk0^T) = (dK, dV, dg, dh0)).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common.engine import GATE_KEY, Problem
from ..gla.pallas_recurrent import _backward as gla_backward
from ..gla.pallas_recurrent import _forward as gla_forward
from .slot_inputs import kernel_call

F32 = jnp.float32


def _t(x):
    """[N, H, A, B] -> [N, H, B, A] (None stays None)."""
    return None if x is None else jnp.swapaxes(x, -1, -2)


def _problem(s, v, h0, cu, scale):
    B, T, H, M = s.shape
    N = B if cu is None else cu.shape[0] - 1
    return Problem(B=B, T=T, H=H, K=M, V=v.shape[-1], N=N, scale=float(scale),
                   varlen=cu is not None, gate=GATE_KEY, has_h0=h0 is not None,
                   precision=None, bt=1)


def _zeros_state(pb):
    return jnp.zeros((pb.N, pb.H, pb.K, pb.V), F32)


def _forward(pbF, pbV, q, k, v, s, g, hk0, hv0, cu):
    hk0t = _t(hk0)
    _, hkt_t = gla_forward(pbF, s, s, k, g, hk0t, cu)
    ok, _, _, _, _ = gla_backward(pbF, s, s, k, g, hk0t, cu, q, _zeros_state(pbF))
    p32 = jax.nn.softmax(ok.astype(F32), axis=-1)
    p = p32.astype(q.dtype)
    o, hvt = gla_forward(pbV, p, s, v, g, hv0, cu)
    return (o, _t(hkt_t), hvt), (p32, p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gsa_recurrent(pbF, pbV, q, k, v, s, g, hk0, hv0, cu):
    return _forward(pbF, pbV, q, k, v, s, g, hk0, hv0, cu)[0]


def _fwd(pbF, pbV, q, k, v, s, g, hk0, hv0, cu):
    out, inner = _forward(pbF, pbV, q, k, v, s, g, hk0, hv0, cu)
    return out, (q, k, v, s, g, hk0, hv0, cu) + inner


def _bwd(pbF, pbV, res, cts):
    q, k, v, s, g, hk0, hv0, cu, p32, p = res
    do, dhkt, dhvt = cts
    dp, ds2, dv, dg2, dhv0 = gla_backward(pbV, p, s, v, g, hv0, cu, do.astype(q.dtype),
                                          dhvt.astype(F32))
    dp = dp.astype(F32)
    dok = (p32 * (dp - jnp.sum(p32 * dp, axis=-1, keepdims=True))).astype(q.dtype)
    hk0t = _t(hk0)
    dq, _ = gla_forward(pbF, dok, s, k, g, hk0t, cu)
    _, ds1, dk, dg1, dhk0t = gla_backward(pbF, dok, s, k, g, hk0t, cu, q,
                                          _t(dhkt.astype(F32)))
    ds = (ds1.astype(F32) + ds2.astype(F32)).astype(s.dtype)
    return dq, dk, dv, ds, dg1 + dg2, _t(dhk0t), dhv0, None


_gsa_recurrent.defvjp(_fwd, _bwd)


def fused_recurrent_gsa_pallas(q, k, v, s, *, g=None, scale, initial_state=None,
                               output_final_state=False, cu_seqlens=None):
    """Pallas (Triton lowering) token-by-token GSA; runs interpreted off-GPU. Arguments and
    returns as gsa.pallas_chunk.chunk_gsa_pallas."""

    def run(q, k, v, s, g, scale, hk0, hv0, cu):
        return _gsa_recurrent(_problem(s, k, hk0, cu, scale), _problem(s, v, hv0, cu, 1.0),
                              q, k, v, s, g, hk0, hv0, cu)

    return kernel_call(run, q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)


__all__ = ["fused_recurrent_gsa_pallas"]
