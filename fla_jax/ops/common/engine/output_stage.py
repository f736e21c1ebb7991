"""Output stage of the chunk engine (chunk-parallel), forward and backward.

One program per (chunk slot, head, V- or K-block). With b the inclusive cumsum of the
log-decay from the chunk start, S = h[slot] (state before the chunk), dS = dh[slot]
(cotangent of the state after it) and A[i, j] = sum_c q_ic k_jc exp(b_ic - b_jc) (j <= i):
    o  = scale ((q exp(b)) S + A v)
    dv = scale A^T do + (k exp(b_last - b)) dS
    dq = scale exp(b) (do S^T) + sum_{j <= i} dA_ij k_j exp(b_i - b_j),   dA = scale do v^T
    dk = exp(b_last - b) (v dS^T) + sum_{i >= j} dA_ij q_i exp(b_i - b_j)
    dg_t = sum_{i >= t} q_i.(dq_inter + dq_strict)_i - sum_{j >= t} k_j.dk_strict_j
           + sum_{j < t} k_j.dk_inter_j + exp(b_last) rowsum(S * dS)     (per key channel)
where "strict" leaves out the pairs i == j: they are O(1) and would cancel in dg (masked off,
never formed), and the prefix sum over j < t never reaches the chunk's last token (whose
k.dk_inter is O(1)); every other term is decayed, so strong gates keep dg's fp32 accuracy.
The chunk is handled in sub-chunks of SUB = 16 tokens (I, J) with R_I = b before sub-chunk I
and loc = the cumsum inside it: pairs of different sub-chunks (J < I) factor as
exp(b_i - b_j) = exp(loc_i) exp(R_I - b_j), both exponents <= 0; pairs inside one sub-chunk are
exact per pair ([SUB, SUB, channels] pair tiles). A scalar gate is the key gate with every channel
equal (its dg is the sum over channels).
Shapes: q, k [B, T, H, K]; v, do [B, T, H, V]; g per the gate switch (fp32); h, dh
[slots, H, Kp, Vp]; outputs in the inputs' dtypes, dg fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .. import pallas_triton as ptr
from . import gates as gt
from . import launch as specs
from . import varlen as vl
from .launch import SUB, Launch, Problem, call, launch_for, width

F32 = jnp.float32


def _chunk(refs, pb):
    """(start row, valid rows) of this program's chunk."""
    s = pl.program_id(0)
    n, bos, c, nv = vl.slot_chunk(refs, pb.varlen, pb.T, pb.bt, s)
    return bos + c * pb.bt, nv


def _gated(pb):
    return pb.gate != gt.GATE_NONE


def _sub_gates(refs, pb, start, nv, w, n_cols, col0):
    """Per sub-chunk I: (loc_I [SUB, w] Cum, R_I [w] Cum), and the chunk total [w] Cum."""
    out, R = [], gt.zero_cum(w)
    for I in range(pb.bt // SUB):
        if not _gated(pb):
            out.append((None, None))
            continue
        g = gt.load_gate(refs["g"], pb.gate, start + I * SUB, SUB, specs.rows(pb, nv - I * SUB),
                         w, specs.cols(n_cols, w), col0)
        loc, tot = gt.cumsum(g)
        out.append((loc, R))
        R = gt.add(R, tot)
    return out, R


def _q_factor(pb, q, gI):
    """q exp(loc_I) (fp32), the query side of a cross-sub-chunk pair."""
    return q.astype(F32) if gI[0] is None else q * jnp.exp(gI[0].value())


def _k_factor(pb, k, gI, gJ):
    """k_J exp(R_I - b_j) (fp32) for rows j of sub-chunk J < I."""
    if gI[0] is None:
        return k.astype(F32)
    return k * jnp.exp(gt.span(gI[1], gJ[1], gJ[0]))


def _pair_decay(loc, mask):
    """[SUB, SUB, w] fp32: exp(loc_i - loc_j) per channel where mask [SUB, SUB] (i, j), else
    0 (masked before exp). loc: the sub-chunk's [SUB, w] Cum; each gap formed part by part."""
    d = ((loc.hi[:, None, :] - loc.hi[None, :, :]) + (loc.lo[:, None, :] - loc.lo[None, :, :]))
    return gt.masked_exp(d, mask[:, :, None])


def _diag_scores(q, k, loc):
    """A_II [SUB, SUB] fp32 of one sub-chunk: sum_c q_ic k_jc exp(loc_ic - loc_jc), j <= i,
    exact per pair ([SUB, SUB, w] pair tile). q, k [SUB, w]; loc [SUB, w] Cum or None."""
    causal = jnp.arange(SUB)[:, None] >= jnp.arange(SUB)[None, :]
    if loc is None:
        e = jnp.broadcast_to(causal[:, :, None], (SUB, SUB, q.shape[1])).astype(F32)
    else:
        e = _pair_decay(loc, causal)
    return jnp.sum(q.astype(F32)[:, None, :] * k.astype(F32)[None, :, :] * e, axis=2)


def _load_cols(ref, rs, rb, cb, c0, kc, gate=gt.GATE_KEY):
    """Rows rs .. rs+SUB, columns c0 .. c0+kc of a [T, D] ref ([T]: a scalar gate, broadcast
    over the columns) as fp32-or-input tile; rows >= rb / columns >= cb read as 0."""
    if gate == gt.GATE_SCALAR:
        g = ptr.load_rows(ref, rs, SUB, rb).astype(F32)
        return jnp.broadcast_to(g[:, None], (SUB, kc))
    view = ref.at[pl.ds(rs, SUB), pl.ds(c0, kc)]
    mask = ptr._mask(SUB, rb, kc, cb, c0)
    return plt.load(view) if mask is None else plt.load(view, mask=mask, other=0.0)


def _load_sub(pb, refs, name, rows, n_cols, col0=0):
    cb = specs.cols(n_cols, refs[name].shape[1])
    return [ptr.load_rows(refs[name], rs, SUB, specs.rows(pb, nv), cb, col0) for rs, nv in rows]


def _store(pb, ref, rs, nv, n_cols, value, col0=0):
    n_cols = None if n_cols is None or value.ndim == 1 else specs.cols(n_cols, value.shape[1])
    ptr.store_rows(ref, rs, specs.rows(pb, nv), n_cols, value, col0)


def _sub_rows(pb, start, nv):
    return [(start + I * SUB, nv - I * SUB) for I in range(pb.bt // SUB)]


# ----------------------------------------------------------------------------- forward
def _slice_gates(refs, pb, rows, cb, k0, kc):
    """Key channels k0 .. k0+kc of every sub-chunk I: (loc_I [SUB, kc] Cum, R_I [kc] Cum)."""
    out, R = [], gt.zero_cum(kc)
    for rs, nvI in rows:
        if not _gated(pb):
            out.append((None, None))
            continue
        loc, tot = gt.cumsum(_load_cols(refs["g"], rs, specs.rows(pb, nvI), cb, k0, kc, pb.gate))
        out.append((loc, R))
        R = gt.add(R, tot)
    return out


def _fwd_kernel(refs, pb, bk, bv):
    """One chunk, head and V-block, one sub-chunk row I at a time: a loop over key-channel
    slices of width bk accumulates its scores A_IJ [SUB, SUB] (J <= I) and (q_I exp(b)) S
    (the tiles of one slice live at a time); then o_I = scale ((q_I exp(b)) S + sum_J A_IJ v_J)."""
    c0 = pl.program_id(2) * bv
    start, nv = _chunk(refs, pb)
    rows = _sub_rows(pb, start, nv)
    dt = refs["q"].dtype
    cb = None if pb.K % bk == 0 else pb.K

    def cols(name, J, k0):
        rs, n = rows[J]
        return _load_cols(refs[name], rs, specs.rows(pb, n), cb, k0, bk)

    for I in range(pb.bt // SUB):
        def body(c, carry, I=I):
            A, O = carry
            k0 = pl.multiple_of(c * bk, bk)
            gs = _slice_gates(refs, pb, rows[:I + 1], cb, k0, bk)
            q = cols("q", I, k0)
            loc, R = gs[I]
            S = plt.load(refs["h"].at[pl.ds(k0, bk), :]).astype(dt)
            qd = q if loc is None else (q * jnp.exp(loc.value() + gt.bcast(R).value())).astype(dt)
            O = O + ptr.matmul(qd, S, (1, 0), pb.precision)
            qf = _q_factor(pb, q, gs[I]).astype(dt)
            A = list(A)
            for J in range(I):
                kf = _k_factor(pb, cols("k", J, k0), gs[I], gs[J]).astype(dt)
                A[J] = A[J] + ptr.matmul(qf, kf, (1, 1), pb.precision)
            A[I] = A[I] + _diag_scores(q, cols("k", I, k0), loc)
            return tuple(A), O

        init = (tuple(jnp.zeros((SUB, SUB), F32) for _ in range(I + 1)), jnp.zeros((SUB, bv), F32))
        A, o = lax.fori_loop(0, pl.cdiv(pb.K, bk), body, init)
        for J in range(I + 1):
            v = ptr.load_rows(refs["v"], rows[J][0], SUB, specs.rows(pb, rows[J][1]),
                              specs.cols(pb.V, bv), c0)
            o = o + ptr.matmul(A[J].astype(dt), v, (1, 0), pb.precision)
        _store(pb, refs["o"], rows[I][0], rows[I][1], pb.V, o * pb.scale, c0)
        if "A" in refs:
            @pl.when(pl.program_id(2) == 0)
            def _():
                for J in range(I + 1):
                    _score_block(refs["A"], pb, rows[I], J, A[J])


def _score_block(ref, pb, rows_I, J, value=None):
    """Sub-block (I, J) [SUB, SUB] of the scores buffer A [T, BT] (rows of sub-chunk I,
    columns of sub-chunk J): stored when `value` is given, else loaded (0 on masked rows)."""
    rs, nvI = rows_I
    view = ref.at[pl.ds(rs, SUB), pl.ds(J * SUB, SUB)]
    rb = specs.rows(pb, nvI)
    mask = None if rb is None else jnp.broadcast_to((jnp.arange(SUB) < rb)[:, None], (SUB, SUB))
    if value is not None:
        plt.store(view, value.astype(ref.dtype), mask=mask)
        return None
    return plt.load(view) if mask is None else plt.load(view, mask=mask, other=0.0)


def _parallel_inputs(pb, cu, seq):
    ins = []
    if pb.varlen:
        ins += [("cu", cu, specs.full(cu)), ("seq", seq, specs.full(seq))]
    return ins


def _gate_input(pb, g, w, col_block):
    if pb.gate == gt.GATE_NONE:
        return []
    return [("g", g, specs.gate_rows(pb, w, col_block, parallel=True))]


def _grid(pb, nb):
    return (pb.n_slots, pb.H, nb)


def output_fwd(pb: Problem, q, k, v, g, h, cu, seq, save_scores=False,
               launch: Launch | None = None):
    """o [B, T, H, V] in q's dtype from q, k [B, T, H, K], v [B, T, H, V], g (gate switch),
    h [slots, H, Kp, Vp] (state_pass_fwd), cu / seq (varlen: cu_seqlens int32 [N+1] and
    varlen.slot_sequences; else None). save_scores: also return A [B, T, H, BT] in q's dtype
    (each token's row of its chunk's scores, the lower sub-blocks written) for output_bwd."""
    launch = launch or launch_for("output_fwd", pb.K, pb.V, q.dtype)
    bk, bv = width(pb.Kp, launch.bk), width(pb.Vp, launch.bv)
    par = dict(parallel=True)
    ins = [("q", q, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("k", k, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("v", v, specs.seq_rows(pb, bv, specs.same, **par))]
    ins += _gate_input(pb, g, pb.Kp, specs.zero) + _parallel_inputs(pb, cu, seq)
    ins.append(("h", h, specs.slot_state(pb.Kp, bv, specs.zero, specs.same)))
    outs = [("o", jax.ShapeDtypeStruct(v.shape, q.dtype), specs.seq_rows(pb, bv, specs.same, **par))]
    if save_scores:
        outs.append(("A", jax.ShapeDtypeStruct(q.shape[:3] + (pb.bt,), q.dtype),
                     specs.seq_rows(pb, pb.bt, specs.zero, **par)))
    r = call(lambda refs: _fwd_kernel(refs, pb, bk, bv), _grid(pb, pl.cdiv(pb.V, bv)), ins, outs,
             launch, "engine_output_fwd")
    return (r["o"], r["A"]) if save_scores else r["o"]


# ----------------------------------------------------------------------------- backward
def _dv_kernel(refs, pb, bv):
    c0 = pl.program_id(2) * bv
    start, nv = _chunk(refs, pb)
    rows = _sub_rows(pb, start, nv)
    ks = _load_sub(pb, refs, "k", rows, pb.K)
    dos = _load_sub(pb, refs, "do", rows, pb.V, c0)
    dt = ks[0].dtype
    gs, tot = _sub_gates(refs, pb, start, nv, pb.Kp, pb.K, 0)
    dS = refs["dh"][...].astype(dt)
    nb = pb.bt // SUB
    for J in range(nb):
        kd = ks[J] if gs[J][0] is None else (ks[J] * jnp.exp(gt.span(tot, gs[J][1], gs[J][0]))).astype(dt)
        dv = ptr.matmul(kd, dS, (1, 0), pb.precision)
        intra = None
        for I in range(J, nb):
            a = _score_block(refs["A"], pb, rows[I], J)
            t = ptr.matmul(a, dos[I], (0, 0), pb.precision)
            intra = t if intra is None else intra + t
        _store(pb, refs["dv"], rows[J][0], rows[J][1], pb.V, dv + pb.scale * intra, c0)


def _diag_grads(q, k, loc, dA):
    """Strict (i > j) in-sub-chunk parts of dq and dk [SUB, w] fp32, exact per pair:
    dq_i = sum_{j<i} dA_ij k_j exp(loc_i - loc_j), dk_j = sum_{i>j} dA_ij q_i exp(loc_i - loc_j).
    q, k [SUB, w]; loc the sub-chunk's [SUB, w] Cum (None: no gate); dA [SUB, SUB] fp32."""
    strict = jnp.arange(SUB)[:, None] > jnp.arange(SUB)[None, :]
    if loc is None:
        wgt = jnp.where(strict, dA, 0.0)[:, :, None]
    else:
        wgt = dA[:, :, None] * _pair_decay(loc, strict)
    dq = jnp.sum(wgt * k.astype(F32)[None, :, :], axis=1)
    dk = jnp.sum(wgt * q.astype(F32)[:, None, :], axis=0)
    return dq, dk


def _dqk_kernel(refs, pb, bk):
    """One chunk, head and K-block: dq, dk (and dg), one sub-chunk I at a time in reverse
    order (the suffix sums of dg then run along; the prefix sums of k.dk_inter come from a
    first pass over the sub-chunks' totals), tiles loaded where used, so few live at once."""
    r0 = pl.program_id(2) * bk
    start, nv = _chunk(refs, pb)
    rows = _sub_rows(pb, start, nv)
    nb = pb.bt // SUB
    dt = refs["q"].dtype
    gated = _gated(pb)
    gs, tot = _sub_gates(refs, pb, start, nv, bk, pb.K, r0)
    S, dS = refs["h"][...].astype(dt), refs["dh"][...].astype(dt)
    ii = jnp.arange(SUB)[:, None]
    eye = ii == jnp.arange(SUB)[None, :]

    def sub(name, I, n_cols, col0=0):
        cb = specs.cols(n_cols, refs[name].shape[1])
        return ptr.load_rows(refs[name], rows[I][0], SUB, specs.rows(pb, rows[I][1]), cb, col0)

    def dA(I, J):
        return pb.scale * ptr.matmul(sub("do", I, pb.V), sub("v", J, pb.V), (1, 1), pb.precision)

    def dk_inter(J):
        y = ptr.matmul(sub("v", J, pb.V), dS, (1, 1), pb.precision)
        return y * jnp.exp(gt.span(tot, gs[J][1], gs[J][0])) if gated else y

    # Cross-sub-chunk pairs J < I. The 16-bit operands are decayed relative to their largest
    # row (q: the sub-chunk's first row, k: its last), every exponent <= 0; the per-channel
    # factors exp(loc_I0) and exp(R_I - R_J+1) are applied to the products in fp32 (in fp16 a
    # strongly decayed operand underflows: fp16 dg 2.3e-3 with gates in [-20, -10], 5e-3 tol).
    def q_side(I, q):
        """(q_I decayed to its first row (dt), exp(loc of that row) [1, w], exp(loc_I))."""
        if not gated:
            return q, 1.0, 1.0
        first = gt.row(gs[I][0], 0)
        qf = (q * jnp.exp(gt.gap(gs[I][0], gt.bcast(first)))).astype(dt)
        return qf, jnp.exp(first.value())[None, :], jnp.exp(gs[I][0].value())

    def k_side(I, J, k):
        """(k_J decayed to its sub-chunk's end (dt), exp(R_I - R_J+1) [1, w],
        exp(R_I - b_j) [SUB, w])."""
        if not gated:
            return k, 1.0, 1.0
        nxt = gs[J + 1][1]
        kf = (k * jnp.exp(gt.span(nxt, gs[J][1], gs[J][0]))).astype(dt)
        return (kf, jnp.exp(gt.gap(gs[I][1], nxt))[None, :],
                jnp.exp(gt.span(gs[I][1], gs[J][1], gs[J][0])))

    if gated:
        rowterm = jnp.exp(tot.value()) * jnp.sum(S.astype(F32) * dS.astype(F32), axis=1)
        last = jnp.minimum(nv, pb.bt) - 1      # the chunk's last token: its k.dk_inter is O(1)

        def k_dk_inter(J, k, y):
            return jnp.where(J * SUB + ii == last, 0.0, k * y)
        before, acc = [], jnp.zeros_like(rowterm)
        for J in range(nb):
            before.append(acc)
            acc = acc + jnp.sum(k_dk_inter(J, sub("k", J, pb.K, r0), dk_inter(J)), axis=0)
        later = jnp.zeros_like(rowterm)
    for I in reversed(range(nb)):
        rs, nvI = rows[I]
        q, k = sub("q", I, pb.K, r0), sub("k", I, pb.K, r0)
        dAII = dA(I, I)
        x = ptr.matmul(sub("do", I, pb.V), S, (1, 1), pb.precision)
        if gated:
            x = x * jnp.exp(gs[I][0].value() + gt.bcast(gs[I][1]).value())
        dq_inter = pb.scale * x
        dq_strict, dk_strict = _diag_grads(q, k, gs[I][0], dAII)
        _, _, qloc = q_side(I, q)
        for J in range(I):
            kf, kscale, _ = k_side(I, J, sub("k", J, pb.K, r0))
            dq_strict = dq_strict + (qloc * kscale) * ptr.matmul(dA(I, J).astype(dt), kf, (1, 0),
                                                                 pb.precision)
        for I2 in range(I + 1, nb):
            qf, qscale, _ = q_side(I2, sub("q", I2, pb.K, r0))
            _, _, kdec = k_side(I2, I, k)
            dk_strict = dk_strict + (kdec * qscale) * ptr.matmul(dA(I2, I).astype(dt), qf, (0, 0),
                                                                 pb.precision)
        y = dk_inter(I)
        ddiag = jnp.sum(jnp.where(eye, dAII, 0.0), axis=1)[:, None]
        _store(pb, refs["dq"], rs, nvI, pb.K, dq_inter + dq_strict + ddiag * k, r0)
        _store(pb, refs["dk"], rs, nvI, pb.K, y + dk_strict + ddiag * q, r0)
        if not gated:
            continue
        yv = q * (dq_inter + dq_strict) - k * dk_strict
        ki = k_dk_inter(I, k, y)
        suf = later[None, :] + (jnp.sum(yv, axis=0)[None, :] - jnp.cumsum(yv, axis=0) + yv)
        later = later + jnp.sum(yv, axis=0)
        pre = before[I][None, :] + (jnp.cumsum(ki, axis=0) - ki)
        dg = suf + pre + rowterm[None, :]
        if pb.gate == gt.GATE_KEY:
            _store(pb, refs["dg"], rs, nvI, pb.K, dg, r0)
        else:
            _store(pb, refs["dg"], rs, nvI, None, jnp.sum(dg, axis=1))


def output_bwd(pb: Problem, q, k, v, g, h, A, do, dh, cu, seq,
               launch_dv: Launch | None = None, launch_dqk: Launch | None = None):
    """Cotangents of output_fwd w.r.t. q, k, v (their dtypes) and the gate (fp32: [B, T, H, K]
    for GATE_KEY, [B, T, H] for GATE_SCALAR, None for GATE_NONE), from do [B, T, H, V],
    dh [slots, H, Kp, Vp] (state_pass_bwd) and the forward's scores A (output_fwd with
    save_scores). dv also carries the state path (k dS)."""
    launch_dv = launch_dv or launch_for("output_dv", pb.K, pb.V, q.dtype)
    launch_dqk = launch_dqk or launch_for("output_dqk", pb.K, pb.V, q.dtype)
    par = dict(parallel=True)
    common = _parallel_inputs(pb, cu, seq)

    bv = width(pb.Vp, launch_dv.bv)
    ins = [("k", k, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("do", do, specs.seq_rows(pb, bv, specs.same, **par)),
           ("A", A, specs.seq_rows(pb, pb.bt, specs.zero, **par))]
    ins += _gate_input(pb, g, pb.Kp, specs.zero) + common
    ins.append(("dh", dh, specs.slot_state(pb.Kp, bv, specs.zero, specs.same)))
    outs = [("dv", jax.ShapeDtypeStruct(v.shape, v.dtype), specs.seq_rows(pb, bv, specs.same, **par))]
    dv = call(lambda refs: _dv_kernel(refs, pb, bv), _grid(pb, pl.cdiv(pb.V, bv)), ins, outs,
              launch_dv, "engine_output_dv")["dv"]

    bk = width(pb.Kp, launch_dqk.bk)
    nkb = pl.cdiv(pb.K, bk)
    ins = [("q", q, specs.seq_rows(pb, bk, specs.same, **par)),
           ("k", k, specs.seq_rows(pb, bk, specs.same, **par)),
           ("v", v, specs.seq_rows(pb, pb.Vp, specs.zero, **par)),
           ("do", do, specs.seq_rows(pb, pb.Vp, specs.zero, **par))]
    ins += _gate_input(pb, g, bk, specs.same) + common
    ins += [("h", h, specs.slot_state(bk, pb.Vp, specs.same, specs.zero)),
            ("dh", dh, specs.slot_state(bk, pb.Vp, specs.same, specs.zero))]
    outs = [("dq", jax.ShapeDtypeStruct(q.shape, q.dtype), specs.seq_rows(pb, bk, specs.same, **par)),
            ("dk", jax.ShapeDtypeStruct(k.shape, k.dtype), specs.seq_rows(pb, bk, specs.same, **par))]
    if pb.gate == gt.GATE_KEY:
        outs.append(("dg", jax.ShapeDtypeStruct(g.shape, F32), specs.seq_rows(pb, bk, specs.same, **par)))
    elif pb.gate == gt.GATE_SCALAR:
        part = jax.ShapeDtypeStruct((nkb,) + g.shape, F32)
        batch = vl.batch_of_slot(pb.varlen, pb.T, pb.bt)
        outs.append(("dg", part, pl.BlockSpec((None, None, pb.T, None),
                                              lambda s, hh, j: (j, batch(s), 0, hh))))
    r = call(lambda refs: _dqk_kernel(refs, pb, bk), _grid(pb, nkb), ins, outs, launch_dqk,
             "engine_output_dqk")
    dg = r.get("dg")
    if pb.gate == gt.GATE_SCALAR:
        dg = jnp.sum(dg, axis=0)
    return r["dq"], r["dk"], dv, dg
