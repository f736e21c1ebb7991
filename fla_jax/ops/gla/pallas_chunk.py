"""Chunked GLA (per-key-channel log-decay) as Pallas kernels: the chunk engine with GATE_KEY.

    forward:  h, ht = state_pass_fwd(k, v, g, h0);  o = output_fwd(q, k, v, g, h)
    backward: dh, dh0 = state_pass_bwd(q, do, g, dht);
              dq, dk, dv, dg = output_bwd(q, k, v, g, h, do, dh)
`engine_chunk` is the same custom_vjp for any gate of the switch (g [B, T, H, K] for
GATE_KEY, [B, T, H] for GATE_SCALAR, None for GATE_NONE).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common import pallas_triton as ptr
from ..common.engine import (GATE_KEY, GATE_NONE, GATE_SCALAR, Problem, output_bwd, output_fwd,
                             state_pass_bwd, state_pass_fwd)
from ..common.engine import varlen as vl


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
    h, ht = state_pass_fwd(pb, k, v, g, h0, cu)
    o = output_fwd(pb, q, k, v, g, h, cu, _seq(pb, cu))
    return o, ht, h


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def engine_chunk(pb, q, k, v, g, h0, cu):
    """(o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32); differentiable w.r.t.
    q, k, v, g, h0 through the engine's backward kernels."""
    o, ht, _ = _forward(pb, q, k, v, g, h0, cu)
    return o, ht


def _fwd(pb, q, k, v, g, h0, cu):
    o, ht, h = _forward(pb, q, k, v, g, h0, cu)
    return (o, ht), (q, k, v, g, h0, cu, h)


def _bwd(pb, res, cts):
    q, k, v, g, h0, cu, h = res
    do, dht = cts
    do = do.astype(q.dtype)
    dh, dh0 = state_pass_bwd(pb, q, do, g, dht.astype(jnp.float32), cu)
    dq, dk, dv, dg = output_bwd(pb, q, k, v, g, h, do, dh, cu, _seq(pb, cu))
    return dq, dk, dv, dg, dh0, None


engine_chunk.defvjp(_fwd, _bwd)


def chunk_gla_pallas(q, k, v, *, g, scale, initial_state=None, output_final_state=False,
                     cu_seqlens=None):
    """Pallas (Triton lowering) chunked GLA; runs interpreted off-GPU.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; one dtype in bf16/fp16/fp32 (K, V <= 256).
        g: fp32 [B, T, H, K] log-decay (<= 0). scale: float.
        initial_state: None or fp32 [N, H, K, V]. cu_seqlens: None or int [N+1] (B == 1),
        may be traced.
    Returns:
        o [B, T, H, V] in q's dtype; final state fp32 [N, H, K, V] or None.
    Differentiable w.r.t. q, k, v, g (fp32 cotangent) and initial_state.
    """
    pb = make_problem(q, v, g, initial_state, cu_seqlens, scale, GATE_KEY)
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    o, ht = engine_chunk(pb, q, k, v, g.astype(jnp.float32), initial_state, cu)
    return o, (ht if output_final_state else None)


__all__ = ["chunk_gla_pallas", "engine_chunk", "make_problem", "GATE_NONE", "GATE_SCALAR",
           "GATE_KEY"]
