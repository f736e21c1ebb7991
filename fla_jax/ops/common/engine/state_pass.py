"""Inter-chunk state pass of the chunk engine (sequential over chunks), forward and backward.

Per sequence n, head h, K-block and V-block (program), chunks in order, with b the in-chunk
inclusive cumsum of the log-decay (gates.py) and b_last its chunk total:
    forward:   h[slot(c)] = S  (the state BEFORE chunk c),
               S <- decay(b_last) S + (k decay(b_last - b))^T v        final state = S
    backward:  dh[slot(c)] = dS (the cotangent of the state AFTER chunk c), walking chunks in
               reverse from dht, dS <- decay(b_last) dS + scale (q decay(b))^T do; dh0 = dS.
decay: 1 (GATE_NONE), exp per token (GATE_SCALAR) or per key channel (GATE_KEY, a row scaling
of S). In the backward, q decay(b) is formed as q exp(b - b_0) (every exponent <= 0, the first
token's factor exp(b_0) applied in fp32 afterwards): in fp16 it would underflow otherwise.
Shapes: k, q [B, T, H, K]; v, do [B, T, H, V] (one dtype); g per the gate switch (fp32);
h0 / dht [N, H, K, V] fp32; h / dh [slots, H, Kp, Vp] in pb.state_dtype.
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
from .launch import Launch, Problem, call, launch_for, width


def _tiles(pb, launch):
    """Tiles over the PADDED head sizes: every tile of h / dh [slots, H, Kp, Vp] is written
    (zeros beyond K / V), so a consumer that reads whole padded tiles (a dot against masked,
    zero q / do columns) never meets unwritten memory (NaN * 0 = NaN): K or V in (128, 192]
    leaves a 64-wide tile past cdiv(K, 64) blocks."""
    bk, bv = width(pb.Kp, launch.bk), width(pb.Vp, launch.bv)
    nk, nv = pl.cdiv(pb.Kp, bk), pl.cdiv(pb.Vp, bv)
    return bk, bv, nk, nv


def _common(pb, bk, kb, cu, g):
    ins = []
    if pb.varlen:
        ins.append(("cu", cu, specs.full(cu)))
    if pb.gate != gt.GATE_NONE:
        ins.append(("g", g, specs.gate_rows(pb, bk, kb)))
    return ins


def _program(refs, pb, bk, bv, nvb):
    n, j = pl.program_id(0), pl.program_id(2)
    r0, c0 = (j // nvb) * bk, (j % nvb) * bv
    bos, L = vl.sequence_bounds(refs, pb.varlen, pb.T, n)
    slot0 = vl.first_slot(pb.varlen, pb.T, pb.bt, n, bos)
    return r0, c0, bos, L, slot0, (L + pb.bt - 1) // pb.bt


def _fwd_kernel(refs, pb, bk, bv, nvb):
    bt = pb.bt
    r0, c0, bos, L, slot0, nt = _program(refs, pb, bk, bv, nvb)
    if pb.has_h0:
        S0 = ptr.load_tile(refs["h0"], pb.K, pb.V, r0, c0)
    else:
        S0 = jnp.zeros((bk, bv), jnp.float32)

    def body(c, S):
        start, nv = bos + c * bt, L - c * bt
        refs["h"][slot0 + c, :, :] = S.astype(refs["h"].dtype)
        v = ptr.load_rows(refs["v"], start, bt, nv, pb.V, c0)
        if "el" in refs:
            # k exp(last - b) and exp(last) given (cumsum_scores): no gate work here
            kg = ptr.load_rows(refs["kg"], start, bt, nv, pb.K, r0)
            return S * refs["el"][slot0 + c, :][:, None] + ptr.matmul(kg, v, (0, 0), pb.precision)
        k = ptr.load_rows(refs["k"], start, bt, nv, pb.K, r0)
        if pb.gate != gt.GATE_NONE:
            g = gt.load_gate(refs["g"], pb.gate, start, bt, nv, bk, pb.K, r0)
            cum, tot = gt.cumsum(g)
            k = (k * jnp.exp(gt.gap(gt.Cum(tot.hi[None, :], tot.lo[None, :]), cum))).astype(v.dtype)
            S = S * jnp.exp(tot.value())[:, None]
        return S + ptr.matmul(k, v, (0, 0), pb.precision)

    S = lax.fori_loop(0, nt, body, S0)
    ptr.store_tile(refs["ht"], S, pb.K, pb.V, r0, c0)


def state_pass_fwd(pb: Problem, k, v, g, h0, cu, launch: Launch | None = None, *, kg=None,
                   el=None):
    """k [B, T, H, K], v [B, T, H, V], g (gate switch) fp32, h0 None or [N, H, K, V] fp32,
    cu None or int32 [N+1]. Returns h [slots, H, Kp, Vp] (pb.state_dtype; the state before
    each chunk) and the final state [N, H, K, V] fp32.
    kg / el (key gate, from cumsum_scores): k exp(last - b) [B, T, H, K] in v's dtype and
    exp(last) [slots, H, Kp] fp32; the loop then does S <- el S + kg^T v (k, g unused)."""
    launch = launch or launch_for("state_fwd", pb.K, pb.V, v.dtype)
    bk, bv, nkb, nvb = _tiles(pb, launch)
    kb, vb = specs.split(nvb)
    if el is not None:
        assert pb.gate == gt.GATE_KEY and kg is not None
        ins = [("kg", kg, specs.seq_rows(pb, bk, kb)), ("v", v, specs.seq_rows(pb, bv, vb)),
               ("el", el, specs.chunk_vecs(pb, bk, kb))]
        if pb.varlen:
            ins.append(("cu", cu, specs.full(cu)))
    else:
        ins = [("k", k, specs.seq_rows(pb, bk, kb)), ("v", v, specs.seq_rows(pb, bv, vb))]
        ins += _common(pb, bk, kb, cu, g)
    if pb.has_h0:
        ins.append(("h0", h0, specs.state(bk, bv, kb, vb)))
    outs = [("h", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp, pb.Vp), pb.state_dtype),
             specs.chunk_states(pb, bk, bv, kb, vb)),
            ("ht", jax.ShapeDtypeStruct((pb.N, pb.H, pb.K, pb.V), jnp.float32),
             specs.state(bk, bv, kb, vb))]
    r = call(lambda refs: _fwd_kernel(refs, pb, bk, bv, nvb), (pb.N, pb.H, nkb * nvb),
             ins, outs, launch, "engine_state_fwd")
    return r["h"], r["ht"]


def _bwd_kernel(refs, pb, bk, bv, nvb):
    bt = pb.bt
    r0, c0, bos, L, slot0, nt = _program(refs, pb, bk, bv, nvb)
    dS0 = ptr.load_tile(refs["dht"], pb.K, pb.V, r0, c0)

    def body(i, dS):
        c = nt - 1 - i
        start, nv = bos + c * bt, L - c * bt
        refs["dh"][slot0 + c, :, :] = dS.astype(refs["dh"].dtype)
        do = ptr.load_rows(refs["do"], start, bt, nv, pb.V, c0)
        if "e0" in refs:
            # q exp(b - b_0), exp(b_0), exp(last) given (state_prep_bwd): no gate work here
            qd = ptr.load_rows(refs["qd"], start, bt, nv, pb.K, r0)
            upd = ptr.matmul(qd, do, (0, 0), pb.precision)
            return (dS * refs["el"][slot0 + c, :][:, None]
                    + (pb.scale * refs["e0"][slot0 + c, :])[:, None] * upd)
        q = ptr.load_rows(refs["q"], start, bt, nv, pb.K, r0)
        if pb.gate == gt.GATE_NONE:
            return dS + pb.scale * ptr.matmul(q, do, (0, 0), pb.precision)
        g = gt.load_gate(refs["g"], pb.gate, start, bt, nv, bk, pb.K, r0)
        cum, tot = gt.cumsum(g)
        first = gt.row(cum, 0)
        qd = (q * jnp.exp(gt.gap(cum, gt.Cum(first.hi[None, :], first.lo[None, :])))).astype(q.dtype)
        upd = ptr.matmul(qd, do, (0, 0), pb.precision)
        return dS * jnp.exp(tot.value())[:, None] + (pb.scale * jnp.exp(first.value()))[:, None] * upd

    dS = lax.fori_loop(0, nt, body, dS0)
    if pb.has_h0:
        ptr.store_tile(refs["dh0"], dS, pb.K, pb.V, r0, c0)


def state_pass_bwd(pb: Problem, q, do, g, dht, cu, launch: Launch | None = None, *,
                   prep=None):
    """q [B, T, H, K], do [B, T, H, V], g (gate switch) fp32, dht [N, H, K, V] fp32 (the final
    state's cotangent). Returns dh [slots, H, Kp, Vp] (pb.state_dtype; the cotangent of the
    state after each chunk) and dh0 [N, H, K, V] fp32 (None without pb.has_h0).
    prep (key gate): state_prep_bwd's (qd, e0, el); the loop then does
    dS <- el dS + scale e0 (qd^T do) (q, g unused)."""
    launch = launch or launch_for("state_bwd", pb.K, pb.V, do.dtype)
    bk, bv, nkb, nvb = _tiles(pb, launch)
    kb, vb = specs.split(nvb)
    if prep is not None:
        assert pb.gate == gt.GATE_KEY
        qd, e0, el = prep
        ins = [("qd", qd, specs.seq_rows(pb, bk, kb)), ("do", do, specs.seq_rows(pb, bv, vb)),
               ("e0", e0, specs.chunk_vecs(pb, bk, kb)), ("el", el, specs.chunk_vecs(pb, bk, kb))]
        if pb.varlen:
            ins.append(("cu", cu, specs.full(cu)))
    else:
        ins = [("q", q, specs.seq_rows(pb, bk, kb)), ("do", do, specs.seq_rows(pb, bv, vb))]
        ins += _common(pb, bk, kb, cu, g)
    ins.append(("dht", dht, specs.state(bk, bv, kb, vb)))
    outs = [("dh", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp, pb.Vp), pb.state_dtype),
             specs.chunk_states(pb, bk, bv, kb, vb))]
    if pb.has_h0:
        outs.append(("dh0", jax.ShapeDtypeStruct((pb.N, pb.H, pb.K, pb.V), jnp.float32),
                     specs.state(bk, bv, kb, vb)))
    r = call(lambda refs: _bwd_kernel(refs, pb, bk, bv, nvb), (pb.N, pb.H, nkb * nvb),
             ins, outs, launch, "engine_state_bwd")
    return r["dh"], r.get("dh0")



def _prep_kernel(refs, pb, bk):
    """Per (slot, head): b = the chunk's gate cumsum, per key block of bk columns."""
    _, bos, c, nv = vl.slot_chunk(refs, pb.varlen, pb.T, pb.bt, pl.program_id(0))
    start, bt = bos + c * pb.bt, pb.bt
    for c0 in range(0, pb.Kp, bk):
        g = ptr.load_block(refs["g"], start, bt, nv, c0, bk, pb.K).astype(jnp.float32)
        q = ptr.load_block(refs["q"], start, bt, nv, c0, bk, pb.K)
        cum, tot = gt.cumsum(g)
        first = gt.row(cum, 0)
        ptr.store_block(refs["qd"], start, nv, c0, pb.K, q * jnp.exp(gt.gap(cum, gt.bcast(first))))
        refs["e0"][pl.ds(c0, bk)] = jnp.exp(first.value())
        refs["el"][pl.ds(c0, bk)] = jnp.exp(tot.value())


def state_prep_bwd(pb: Problem, q, g, cu, seq, launch: Launch | None = None):
    """Key gate: the gate work of state_pass_bwd's loop done chunk-parallel, out of the
    sequential pass: qd = q exp(b - b_0) [B, T, H, K] in q's dtype (every exponent <= 0: fp16's
    range holds it under any gate; q exp(b) would underflow), e0 = exp(b_0) and el = exp(last)
    [slots, H, Kp] fp32 (1 past K), b the in-chunk inclusive cumsum of g [B, T, H, K] fp32.
    cu / seq: varlen cu_seqlens int32 [N+1] and varlen.slot_sequences (else None)."""
    launch = launch or launch_for("state_bwd", pb.K, pb.V, q.dtype)
    bk = min(pb.Kp, 64)
    rows = specs.seq_rows(pb, pb.Kp, specs.zero, parallel=True)
    ins = [("q", q, rows), ("g", g, rows)]
    if pb.varlen:
        ins += [("cu", cu, specs.full(cu)), ("seq", seq, specs.full(seq))]
    vec = jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp), jnp.float32)
    outs = [("qd", jax.ShapeDtypeStruct(q.shape, q.dtype), rows),
            ("e0", vec, specs.slot_vec(pb.Kp)), ("el", vec, specs.slot_vec(pb.Kp))]
    r = call(lambda refs: _prep_kernel(refs, pb, bk), (pb.n_slots, pb.H, 1), ins, outs,
             Launch(None, None, 4, 1), "engine_state_prep_bwd")
    return r["qd"], r["e0"], r["el"]
