"""Backward of chunk_simple_gla on Mosaic GPU kernels (K, V <= 128; mosaic_bwd_kernels.py).

Three kernels: the forward recomputes the state entering every chunk (mosaic_fwd, states
mode), `dstate` runs the state gradient backwards over the chunks (and gives dh0), `grads`
forms dq, dk, dv and the two per-row gate terms of every chunk in parallel; the gate gradient
is their in-chunk (reverse / exclusive) cumsums (XLA, common/mosaic/gate_rows.py). States and
state gradients are kept in q's dtype between kernels, as FLA does. With a sequence split
(mosaic_split.py) both serial passes run per piece from the true piece boundary states and
gradients.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.mosaic import packing, piece_scan
from . import mosaic_bwd_kernels as kernels
from . import mosaic_fwd, mosaic_split
from .mosaic_inputs import chunk_cumsum, chunk_gate_grad, flat, layout, log_decay

MAX_HEAD = 128      # all of K and V of one chunk in SMEM


def supports(K: int, V: int) -> bool:
    return K <= MAX_HEAD and V <= MAX_HEAD


def backward(cfg, q, k, v, g, gamma, h0, cu, do, dht, hs=None):
    """Gradients (dq, dk, dv, dg or None, dh0 or None) of (o, final state) with cotangents
    do [B, T, H, V] (q's dtype) and dht [N, H, K, V] fp32. hs: None (recomputed here) or the
    states entering each chunk as the training forward stored them (mosaic_fwd_ws states:
    [B, H, Tp // 64, V, K], or [1, H, B * Tp // 64, V, K] with a sequence split)."""
    lay = layout(cfg.T, cu)
    a = packing.pack(log_decay(q, g, gamma), lay)
    qp, kp, vp, dop = (packing.pack(x, lay) for x in (q, k, v, do.astype(q.dtype)))
    h0t = None if h0 is None else jnp.swapaxes(h0, -1, -2)
    dhtt = jnp.swapaxes(dht, -1, -2)
    P = cfg.pieces
    if P == 1:
        g2 = chunk_cumsum(a)
        seq, n = lay.seq, cfg.N
        starts, ends = h0t, dhtt
    else:
        B, Tp = qp.shape[:2]
        qp, kp, vp, dop = (flat(x) for x in (qp, kp, vp, dop))
        g2 = chunk_cumsum(flat(a))
        seq, n = mosaic_split.table(B, Tp // mosaic_fwd.C, P), B * P
        D = mosaic_split.piece_factor(mosaic_split.piece_decay(g2, B, P))
        if hs is None:
            _, E = mosaic_fwd.forward(qp, kp, vp, g2, None, seq, scale=cfg.scale, n_seqs=n,
                                      out_final=True, mode="final")
            starts, _ = piece_scan.diagonal_starts(E, D, h0t, B, P)
        zeros = jnp.zeros((n,) + dhtt.shape[1:], jnp.float32)
        _, F = kernels.dstate(qp, dop, g2, zeros, seq, scale=cfg.scale, n_seqs=n,
                              want_dh0=True)
        ends, dh0t_split = piece_scan.diagonal_ends(F, D, dhtt, B, P)
    if hs is None:
        hs, _ = mosaic_fwd.forward(qp, kp, vp, g2, starts, seq, scale=cfg.scale, n_seqs=n,
                                   out_final=False, mode="states")
    dhs, dh0t = kernels.dstate(qp, dop, g2, ends, seq, scale=cfg.scale, n_seqs=n,
                               want_dh0=h0 is not None and P == 1)
    dq, dk, dv, r1, r2 = kernels.grads(qp, kp, vp, dop, g2, hs, dhs, scale=cfg.scale)
    if P > 1:
        dh0t = dh0t_split
        dq, dk, dv = (x.reshape(q.shape[:1] + (-1,) + x.shape[2:]) for x in (dq, dk, dv))
        r1, r2 = (jnp.transpose(r.reshape(r.shape[1], q.shape[0], -1), (1, 0, 2))
                  for r in (r1, r2))
    dq, dk, dv = (packing.unpack(x, lay) for x in (dq, dk, dv))
    dg = None if g is None else chunk_gate_grad(r1, r2, lay).astype(g.dtype)
    dh0 = None if h0 is None else jnp.swapaxes(dh0t, -1, -2)
    return dq, dk, dv, dg, dh0
