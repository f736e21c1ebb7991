"""Inter-chunk state pass of the per-key-gated delta rule (Pallas, Triton lowering), forward
and backward: the mirror of fla_torch/ops/common/engine/delta_state.py.

One program per (sequence, head, V block) walks the chunks of its sequence with the whole K
of the state tile [Kp, BV] fp32. With w, u from wy.py (w relative to the chunk's first row),
b the in-chunk cumsum of the log-decay (split, gates.py), b_0 its first row, `last` its value
at the chunk's end, kg = k exp(last - b) and e0 = exp(b_0), el = exp(last):
    forward:  h[slot] = S (the state before the chunk, in pb.state_dtype)
              vn = u - w (diag(e0) S)                        (stored in u's dtype)
              S <- diag(el) S + kg^T vn;   final state = S (fp32)
    backward: dh[slot] = dS (the gradient of the state after the chunk, pb.state_dtype)
              dvn = scale Aqk^T do + kg dS                   (stored fp32)
              dS <- diag(el) dS + diag(e0) (scale (q exp(b - b_0))^T do - w^T dvn);
              dh0 = dS before the first chunk
Shapes: k, q, w [B, T, H, K]; u, do [B, T, H, V] (one dtype); g [B, T, H, K] fp32;
Aqk [slots, H, BT, BT] fp32; h0 / dht [N, H, K, V] fp32; h / dh [slots, H, Kp, Vp].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from . import gates as gt
from . import specs
from . import varlen as vl
from .launch import Launch, Problem, call

F32 = jnp.float32


def _launch(pb, dtype):
    """The whole K per program, a V block keeping the [Kp, BV] fp32 state tile <= 64 KiB."""
    bv = min(pb.Vp, 64 if pb.Kp <= 128 and jnp.dtype(dtype).itemsize < 4 else 32)
    return bv, Launch(None, bv, 4, 1 if jnp.dtype(dtype).itemsize == 4 else 2)


def _program(refs, pb, bv):
    n, j = pl.program_id(0), pl.program_id(2)
    bos, L = vl.sequence_bounds(refs, pb.varlen, pb.T, n)
    slot0 = vl.first_slot(pb.varlen, pb.T, pb.bt, n, bos)
    return j * bv, bos, L, slot0, (L + pb.bt - 1) // pb.bt


def _gates(refs, pb, start, nv):
    """(cum [BT, Kp] Cum, e0 = exp(b_0) [Kp], el = exp(last) [Kp], kg factor exp(last - b))."""
    g = gt.load_gate(refs["g"], gt.GATE_KEY, start, pb.bt, nv, pb.Kp, pb.K)
    cum, tot = gt.cumsum(g)
    first = gt.row(cum, 0)
    return cum, first, jnp.exp(first.value()), jnp.exp(tot.value()), \
        jnp.exp(gt.gap(gt.bcast(tot), cum))


def _fwd_kernel(refs, pb, bv):
    bt, prec = pb.bt, pb.precision
    c0, bos, L, slot0, nt = _program(refs, pb, bv)
    if pb.has_h0:
        S0 = ptr.load_tile(refs["h0"], pb.K, pb.V, 0, c0)
    else:
        S0 = jnp.zeros((pb.Kp, bv), F32)

    def body(c, S):
        start, nv = bos + c * bt, L - c * bt
        refs["h"][slot0 + c, :, :] = S.astype(refs["h"].dtype)
        w = ptr.load_rows(refs["w"], start, bt, nv, pb.K)
        dt = w.dtype
        u = ptr.load_rows(refs["u"], start, bt, nv, pb.V, c0)
        k = ptr.load_rows(refs["k"], start, bt, nv, pb.K)
        _, _, e0, el, ekg = _gates(refs, pb, start, nv)
        vn = u.astype(F32) - ptr.matmul(w, (S * e0[:, None]).astype(dt), (1, 0), prec)
        ptr.store_rows(refs["vn"], start, nv, pb.V, vn, c0)
        kg = (k * ekg).astype(dt)
        return S * el[:, None] + ptr.matmul(kg, vn.astype(dt), (0, 0), prec)

    S = lax.fori_loop(0, nt, body, S0)
    ptr.store_tile(refs["ht"], S, pb.K, pb.V, 0, c0)


def _specs(pb, bv):
    """(rows spec of a K-wide input, of a V-block input, state tile spec, chunk-states spec)."""
    return (specs.seq_rows(pb, pb.Kp, specs.zero), specs.seq_rows(pb, bv, specs.same),
            specs.state(pb.Kp, bv, specs.zero, specs.same),
            specs.chunk_states(pb, pb.Kp, bv, specs.zero, specs.same))


def delta_state_fwd(pb: Problem, k, w, u, g, h0, cu):
    """k, w [B, T, H, K], u [B, T, H, V] (one dtype), g [B, T, H, K] fp32, h0 None or
    [N, H, K, V] fp32, cu None or int32 [N+1]. Returns (h [slots, H, Kp, Vp] in
    pb.state_dtype, vn [B, T, H, V] in u's dtype, final state [N, H, K, V] fp32)."""
    bv, launch = _launch(pb, u.dtype)
    krow, vrow, st, chunk = _specs(pb, bv)
    ins = [("k", k, krow), ("w", w, krow), ("u", u, vrow), ("g", g, krow)]
    if pb.varlen:
        ins.append(("cu", cu, specs.full(cu)))
    if pb.has_h0:
        ins.append(("h0", h0, st))
    outs = [("h", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp, pb.Vp), pb.state_dtype),
             chunk),
            ("vn", jax.ShapeDtypeStruct(u.shape, u.dtype), vrow),
            ("ht", jax.ShapeDtypeStruct((pb.N, pb.H, pb.K, pb.V), F32), st)]
    r = call(lambda refs: _fwd_kernel(refs, pb, bv), (pb.N, pb.H, pl.cdiv(pb.V, bv)), ins,
             outs, launch, "kda_state_fwd")
    return r["h"], r["vn"], r["ht"]


def _bwd_kernel(refs, pb, bv):
    bt, prec = pb.bt, pb.precision
    c0, bos, L, slot0, nt = _program(refs, pb, bv)
    dS0 = ptr.load_tile(refs["dht"], pb.K, pb.V, 0, c0)

    def body(i, dS):
        c = nt - 1 - i
        start, nv = bos + c * bt, L - c * bt
        refs["dh"][slot0 + c, :, :] = dS.astype(refs["dh"].dtype)
        q = ptr.load_rows(refs["q"], start, bt, nv, pb.K)
        dt = q.dtype
        k = ptr.load_rows(refs["k"], start, bt, nv, pb.K)
        w = ptr.load_rows(refs["w"], start, bt, nv, pb.K)
        do = ptr.load_rows(refs["do"], start, bt, nv, pb.V, c0)
        A = refs["Aqk"][slot0 + c, :, :]
        cum, first, e0, el, ekg = _gates(refs, pb, start, nv)
        kg = (k * ekg).astype(dt)
        dvn = (pb.scale * ptr.matmul(A, do.astype(F32), (0, 0), prec)
               + ptr.matmul(kg, dS.astype(dt), (1, 0), prec))
        ptr.store_rows(refs["dvn"], start, nv, pb.V, dvn, c0)
        qd = (q * jnp.exp(gt.gap(cum, gt.bcast(first)))).astype(dt)
        upd = pb.scale * ptr.matmul(qd, do, (0, 0), prec) \
            - ptr.matmul(w.astype(F32), dvn, (0, 0), prec)
        return dS * el[:, None] + e0[:, None] * upd

    dS = lax.fori_loop(0, nt, body, dS0)
    if pb.has_h0:
        ptr.store_tile(refs["dh0"], dS, pb.K, pb.V, 0, c0)


def delta_state_bwd(pb: Problem, q, k, w, g, Aqk, do, dht, cu):
    """q, k, w [B, T, H, K], do [B, T, H, V] (one dtype), g [B, T, H, K] fp32, Aqk
    [slots, H, BT, BT] fp32 (delta_scores), dht [N, H, K, V] fp32. Returns (dh
    [slots, H, Kp, Vp] in pb.state_dtype, dvn [B, T, H, V] fp32, dh0 [N, H, K, V] fp32 or
    None without pb.has_h0)."""
    bv, launch = _launch(pb, do.dtype)
    krow, vrow, st, chunk = _specs(pb, bv)
    ins = [("q", q, krow), ("k", k, krow), ("w", w, krow), ("do", do, vrow), ("g", g, krow),
           ("Aqk", Aqk, specs.chunk_states(pb, pb.bt, pb.bt, specs.zero, specs.zero)),
           ("dht", dht, st)]
    if pb.varlen:
        ins.append(("cu", cu, specs.full(cu)))
    outs = [("dh", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp, pb.Vp), pb.state_dtype),
             chunk),
            ("dvn", jax.ShapeDtypeStruct(do.shape, F32), vrow)]
    if pb.has_h0:
        outs.append(("dh0", jax.ShapeDtypeStruct((pb.N, pb.H, pb.K, pb.V), F32), st))
    r = call(lambda refs: _bwd_kernel(refs, pb, bv), (pb.N, pb.H, pl.cdiv(pb.V, bv)), ins,
             outs, launch, "kda_state_bwd")
    return r["dh"], r["dvn"], r.get("dh0")
