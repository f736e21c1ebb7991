"""Backward of the Mosaic GPU gated delta rule (the delta rule with g = None), K, V <= 128:
the forward's residuals, the Mosaic reverse state pass (mosaic_bwd_kernel.py), the Mosaic
per-chunk gradient kernel (mosaic_bwd_grads.py), and XLA for the layout, the in-chunk cumsums
of the gate gradient (common/mosaic/gate_rows.py) and the GQA group sums.

Residuals (mosaic_chunk.forward(..., residuals=True)): hs [NC, HV, V, K] the transposed state
entering each chunk and vnT [HV, V, R] v_new transposed (both in q's dtype, stored by the fused
forward), T0 [HV, R, C] the gate-free inverse and -W' [HV, R, K] the WY keys relative to each
chunk's first row (both from mosaic_kkt.py; -W' only when the reverse pass reads it: REVERSE
"wy", else None). The reverse pass (mosaic_bwd_states_ws.py from T0, or mosaic_bwd_kernel.py
from -W') turns them, do and dht into L^T per chunk (the cotangent of the state the chunk
hands on), dv_new and dh0; the gradient kernel then
gives dq, dk, dv, dbeta and the two per-row gate terms r1, r2, with
    dg_t = sum_{s >= t in t's chunk} r1_s + sum_{s < t in t's chunk} r2_s.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common.mosaic.gate_rows import chunk_gate_grad
from ..common.pallas_delta_layout import l2norm_fwd
from . import mosaic_pieces
from .mosaic_bwd_grads import MAX_HEAD, chunk_grads
from .mosaic_bwd_kernel import reverse_states
from .mosaic_bwd_states_ws import reverse_states_ws
from .mosaic_fwd_kernel import C
from .mosaic_gates import gate_inputs
from .mosaic_layout import from_rows, l2norm, plan, to_rows

F32 = jnp.float32
# The sequence split's first reverse run (the state gradient leaving each piece from a zero end
# gradient): "nostore" (the default: a kernel variant that stores no tiles) or "storing" (the
# reverse pass's own kernel, its dh / dv_new tiles written and discarded: one Mosaic kernel fewer
# to compile in a first call at T32768, the no-store variant's 1.1-1.6 s (RESULTS.md run 28; it
# is still lowered twice), for those stores; opt-in, interpreted and lowered, not yet timed on a
# GPU)
NOSTORE_RUN = "nostore"
NOSTORE_RUNS = ("nostore", "storing")

__all__ = ["MAX_HEAD", "backward", "reverse_from_t0"]
# The reverse state pass: "ws" (mosaic_bwd_states_ws.py: three warpgroups, reads T0, so the
# training forward's T0 kernel forms no -W') or "wy" (mosaic_bwd_kernel.py: one warpgroup,
# reads -W')
REVERSE = "ws"
REVERSES = ("ws", "wy")


def reverse_from_t0() -> bool:
    """The reverse pass reads T0 (REVERSE = "ws"): the forward keeps no -W' residual."""
    if REVERSE not in REVERSES:
        raise ValueError(f"mosaic_bwd.REVERSE: got {REVERSE!r}, expected one of {REVERSES}")
    return REVERSE == "ws"


def backward(q, k, v, g, beta, h0, cu_seqlens, do, dht, *, scale: float, l2: bool, resid):
    """Cotangents (dq, dk, dv, dg or None, dbeta, dh0 or None) of the Mosaic forward, each in
    its input's dtype; shapes as in mosaic_chunk.forward. do: [B, T, HV, V];
    dht: None or [N, HV, K, V] fp32. resid: (hs, vnT, t0, wneg, maps) from
    mosaic_chunk.forward(..., residuals=True); with maps (the forward's sequence split) the
    reverse pass runs over the pieces (mosaic_pieces.py)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    group = HV // H
    dtype = q.dtype
    hs, vnT, t0, wneg, maps = resid
    qn, kn = (l2norm(q), l2norm(k)) if l2 else (q, k)
    lay, table = plan(B, T, cu_seqlens)
    qr, kr, vr = to_rows(qn, lay), to_rows(kn, lay), to_rows(v, lay)
    br = to_rows(beta.astype(F32), lay)
    R = qr.shape[0]
    gcum, gsuf, bt = gate_inputs(None if g is None else to_rows(g.astype(F32), lay), br)
    dor = to_rows(do.astype(dtype), lay)                                # [R, HV, V]
    dhtT = None if dht is None else jnp.swapaxes(dht.astype(F32), -1, -2)
    if wneg is None:    # the forward formed no -W' (reverse_from_t0)
        args = (qr, kr, t0, dor, gcum, gsuf, bt)
        seqs, ends = table, dhtT
        if maps is not None:    # the forward's sequence split (mosaic_pieces.py): the state
            # gradient leaving each piece from the pass without stores and the scan
            N = table.shape[0]
            P = maps.shape[0] // N
            if NOSTORE_RUN not in NOSTORE_RUNS:
                raise ValueError(f"mosaic_bwd.NOSTORE_RUN={NOSTORE_RUN!r}; expected one of "
                                 f"{NOSTORE_RUNS}")
            skip = mosaic_pieces.piece_table(table, P, skip_first=True)
            if NOSTORE_RUN == "storing":    # the storing kernel, its tiles discarded
                f = reverse_states_ws(*args, skip, None, scale=scale, group=group)[2]
            else:
                f, = reverse_states_ws(*args, skip, None, scale=scale, group=group, store=False)
            seqs = mosaic_pieces.piece_table(table, P)
            ends = mosaic_pieces.backward_ends(f, maps, dhtT, N, P, K)
        lamT, dvnT, dh0T = reverse_states_ws(*args, seqs, ends, scale=scale, group=group)
        if maps is not None:
            dh0T = mosaic_pieces.first_piece(dh0T, N, P)
    else:
        lamT, dvnT, dh0T = reverse_states(qr, kr, wneg, dor, gcum, gsuf, table, dhtT,
                                          scale=scale, group=group)
    dq, dk, dv, db, r1, r2 = chunk_grads(qr, kr, vr, dor, t0, hs, lamT, vnT, dvnT, gcum, gsuf,
                                         bt, scale=scale, group=group, gated=g is not None)
    if group > 1:   # the group's value heads share q / k: sum their gradients in fp32
        dq = dq.astype(F32).reshape(R, H, group, K).sum(2)
        dk = dk.astype(F32).reshape(R, H, group, K).sum(2)
    dq, dk = from_rows(dq, lay, B), from_rows(dk, lay, B)
    if l2:
        dq = jax.vjp(l2norm_fwd, q.astype(F32))[1](dq.astype(F32))[0]
        dk = jax.vjp(l2norm_fwd, k.astype(F32))[1](dk.astype(F32))[0]
    dv = from_rows(dv, lay, B)
    db = from_rows(db.T, lay, B)
    dg = None if g is None else from_rows(chunk_gate_grad(r1, r2, C).T, lay, B).astype(g.dtype)
    dh0 = None if h0 is None else jnp.swapaxes(dh0T, -1, -2).astype(h0.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg,
            db.astype(beta.dtype), dh0)
