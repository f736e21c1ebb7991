"""Backward of chunk_simple_gla on Mosaic GPU kernels (K, V <= 128; mosaic_bwd_kernels.py).

Three kernels: the forward recomputes the state entering every chunk (mosaic_fwd, states
mode), `dstate` runs the state gradient backwards over the chunks (and gives dh0), `grads`
forms dq, dk, dv and the per-row gate terms of every chunk in parallel; the gate gradient is
their in-chunk reverse cumsum (XLA). States and state gradients are kept in q's dtype
between kernels, as FLA does.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.mosaic import packing
from . import mosaic_bwd_kernels as kernels
from . import mosaic_fwd
from .mosaic_inputs import chunk_reverse_cumsum, gate_cumsum, layout, log_decay

MAX_HEAD = 128      # all of K and V of one chunk in SMEM


def supports(K: int, V: int) -> bool:
    return K <= MAX_HEAD and V <= MAX_HEAD


def backward(cfg, q, k, v, g, gamma, h0, cu, do, dht):
    """Gradients (dq, dk, dv, dg or None, dh0 or None) of (o, final state) with cotangents
    do [B, T, H, V] (q's dtype) and dht [N, H, K, V] fp32."""
    lay = layout(cfg.T, cu)
    g2 = gate_cumsum(log_decay(q, g, gamma), lay)
    qp, kp, vp, dop = (packing.pack(x, lay) for x in (q, k, v, do.astype(q.dtype)))
    h0t = None if h0 is None else jnp.swapaxes(h0, -1, -2)
    hs, _ = mosaic_fwd.forward(qp, kp, vp, g2, h0t, lay.seq, scale=cfg.scale, n_seqs=cfg.N,
                               out_final=False, states=True)
    dhs, dh0t = kernels.dstate(qp, dop, g2, jnp.swapaxes(dht, -1, -2), lay.seq,
                               scale=cfg.scale, n_seqs=cfg.N, want_dh0=h0 is not None)
    dq, dk, dv, r = kernels.grads(qp, kp, vp, dop, g2, hs, dhs, scale=cfg.scale)
    dq, dk, dv = (packing.unpack(x, lay) for x in (dq, dk, dv))
    dg = None if g is None else chunk_reverse_cumsum(r, lay).astype(g.dtype)
    dh0 = None if h0 is None else jnp.swapaxes(dh0t, -1, -2)
    return dq, dk, dv, dg, dh0
