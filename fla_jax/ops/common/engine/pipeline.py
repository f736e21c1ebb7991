"""The engine's stages in order, forward and backward, for a gated chunked recurrence (Pallas):
the mirror of fla_torch/ops/common/engine/pipeline.py.

    forward (key gate):   A, qg, kg, el = cumsum_scores(q, k, g);
                          h, ht = state_pass_fwd(kg, v, el, h0);  o = output_fwd(qg, v, h, A)
    forward (otherwise):  h, ht = state_pass_fwd(k, v, g, h0);  o = output_fwd(q, k, v, g, h)
    backward: dh, dh0 = state_pass_bwd(q, do, g, dht)   (key gate: on state_prep_bwd's
                                                        qd, e0, el, formed chunk-parallel);
              dq, dk, dv, dg = output_bwd_from_scores(q, k, v, g, A, h, do, dh)   (key gate)
                             = output_bwd(q, k, v, g, h, do, dh)                  (otherwise)
`engine_chunk` is one custom_vjp for every gate of the switch (g [B, T, H, K] for GATE_KEY,
[B, T, H] for GATE_SCALAR, None for GATE_NONE; its residuals keep the key gate's A for the
backward); `make_problem` builds its static Problem.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import pallas_triton as ptr
from . import varlen as vl
from .launch import Problem
from .cumsum_scores import cumsum_scores
from .gates import GATE_KEY
from .output_grads import output_bwd_from_scores
from .output_stage import output_bwd, output_fwd
from .state_pass import state_pass_bwd, state_pass_fwd, state_prep_bwd


def make_problem(q, v, g, initial_state, cu_seqlens, scale, gate, bt=64):
    """Problem for q [B, T, H, K], v [B, T, H, V] and the gate switch `gate`."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return Problem(B=B, T=T, H=H, K=K, V=v.shape[-1], N=N, scale=float(scale),
                   varlen=cu_seqlens is not None, gate=gate, has_h0=initial_state is not None,
                   precision=ptr.dot_precision(), bt=bt, state_dtype=jnp.dtype(q.dtype).name)


def _seq(pb, cu):
    return vl.slot_sequences(cu, pb.T, pb.bt) if pb.varlen else None


def _forward(pb, q, k, v, g, h0, cu):
    """(o, final state, h, saved): saved = (A, kg, fits), the key gate's intra-chunk scores,
    k exp(last - b) and the diagonal-block flags (cumsum_scores) for the backward, None for
    the other gates."""
    seq = _seq(pb, cu)
    if pb.gate == GATE_KEY:
        A, qg, kg, el, fits = cumsum_scores(pb, q, k, g, cu, seq, with_fits=True)
        h, ht = state_pass_fwd(pb, None, v, None, h0, cu, kg=kg, el=el)
        return (output_fwd(pb, None, None, v, None, h, cu, seq, A=A, qg=qg), ht, h,
                (A, kg, fits))
    h, ht = state_pass_fwd(pb, k, v, g, h0, cu)
    return output_fwd(pb, q, k, v, g, h, cu, seq), ht, h, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def engine_chunk(pb, q, k, v, g, h0, cu):
    """(o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32); differentiable w.r.t.
    q, k, v, g, h0 through the engine's backward kernels."""
    o, ht, _, _ = _forward(pb, q, k, v, g, h0, cu)
    return o, ht


def _fwd(pb, q, k, v, g, h0, cu):
    o, ht, h, saved = _forward(pb, q, k, v, g, h0, cu)
    return (o, ht), (q, k, v, g, h0, cu, h, saved)


def _bwd(pb, res, cts):
    q, k, v, g, h0, cu, h, saved = res
    do, dht = cts
    do = do.astype(q.dtype)
    seq = _seq(pb, cu)
    if saved is not None:
        prep = state_prep_bwd(pb, q, g, cu, seq)
        dh, dh0 = state_pass_bwd(pb, None, do, None, dht.astype(jnp.float32), cu, prep=prep)
        A, kg, fits = saved
        dq, dk, dv, dg = output_bwd_from_scores(pb, q, k, v, g, A, h, do, dh, cu, seq, kg=kg,
                                                fits=fits)
    else:
        dh, dh0 = state_pass_bwd(pb, q, do, g, dht.astype(jnp.float32), cu)
        dq, dk, dv, dg = output_bwd(pb, q, k, v, g, h, do, dh, cu, _seq(pb, cu))
    return dq, dk, dv, dg, dh0, None


engine_chunk.defvjp(_fwd, _bwd)
