"""Host side of the simple-GLA Mosaic kernels: chunk-aligned layout and gate cumsums.

The log-decay a = g + g_gamma (fp32, [B, T, H]) is packed like q/k/v (packing.py: padding rows
get a = 0, so a sequence's last chunk decays only through its real rows) and turned into the
chunk-local cumsum in log2 units, head-major [Bq, H, Tp], which the kernels read per chunk.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..common.mosaic import gate_rows, packing
from ..common.mosaic.tiles import LOG2E
from .mosaic_fwd import C, SEQ_COLS


def layout(T, cu):
    return packing.plan(T, cu, C, SEQ_COLS)


def log_decay(q, g, gamma):
    """a = g + gamma as fp32 [B, T, H] (zeros without either)."""
    a = jnp.zeros(q.shape[:3], jnp.float32) if g is None else g.astype(jnp.float32)
    if gamma is not None:
        a = a + gamma.astype(jnp.float32)[None, None, :]
    return a


def chunk_cumsum(a):
    """a [Bq, Tp, H] fp32 (chunk-aligned) -> [Bq, H, Tp] chunk-local cumsum times log2(e)."""
    Bq, Tp, H = a.shape
    a = jnp.cumsum(a.reshape(Bq, Tp // C, C, H), axis=2).reshape(Bq, Tp, H)
    return jnp.swapaxes(a * LOG2E, 1, 2)


def chunk_gate_grad(r1, r2, lay):
    """r1, r2 [Bq, H, Tp] fp32 -> dg [B, T, H] in the caller's layout
    (common/mosaic/gate_rows.py; mosaic_bwd_kernels.grads)."""
    dg = gate_rows.chunk_gate_grad(r1, r2, C)
    return packing.unpack(jnp.swapaxes(dg, 1, 2), lay)


def flat(x):
    """[B, Tp, ...] -> [1, B * Tp, ...] (the batch rows as one packed row; a free reshape)."""
    return x.reshape((1, x.shape[0] * x.shape[1]) + x.shape[2:])
