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
exp(b_i - b_j) = exp(loc_i) exp(R_I - b_j), both exponents <= 0; pairs inside one sub-chunk
are exact per pair in the scores (a loop over its 16 columns); in dq / dk they factor through
the sub-chunk's start when its decay stays under gates.SPAN nats (one fp32-accurate dot),
else per pair. A scalar gate is the key gate with every channel
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
from . import specs
from . import varlen as vl
from .launch import SUB, Launch, Problem, blocks, call, launch_for, width

F32 = jnp.float32


def _row(ref, t, ok, n_cols, col0, width=None):
    """Row t of a [T, D] ref as [D] fp32 (col0: the column index of the ref's first column);
    width given: only the columns col0 .. col0 + width of a ref whose first column is 0
    ([width]). Zeros unless `ok`; columns >= n_cols masked."""
    if width is None:
        view, cols = ref.at[t, :], col0 + jnp.arange(ref.shape[1])
    else:
        view, cols = ref.at[t, pl.ds(col0, width)], col0 + jnp.arange(width)
    return plt.load(view, mask=(cols < n_cols) & ok, other=0.0).astype(F32)


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
        g = gt.load_gate(refs["g"], pb.gate, start + I * SUB, SUB, nv - I * SUB, w, n_cols, col0)
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


def _diag_fits(loc) -> object:
    """True (traced) when the decay across the sub-chunk stays under SPAN: its diagonal block
    then factors through the sub-chunk's start, exp(loc_i - loc_j) = exp(loc_i) exp(-loc_j),
    with both factors exact fp32 numbers (one fp32-accurate dot instead of 16 column steps)."""
    return jnp.max(-loc.value()) < gt.SPAN


def diag_fix_kernel(refs, pb, bk, mats):
    """Second kernel of a "split" diagonal (delta_scores, cumsum_scores): one program per
    (chunk slot, head, sub-chunk I) adds to the diagonal block I of each score matrix, in
    place, the exact per-pair terms of the scores kernel's key blocks (of bk columns) whose
    flag (refs['fits'], int32 [Kp / bk]) is 0 (the scores kernel dropped its factored dot
    there); nothing runs where every flag is 1. mats: {output ref: (left operand ref, strict)}
    for M_ij = sum_c x_ic k_jc exp(loc_ic - loc_jc), j <= i (strict: j < i). SUB column steps
    per key block, step j reading key row j and its raw gate (their running split sum gives
    loc_j: no row of a tile is extracted), every exponent <= 0; the sums in fp32, the block
    rounded once to its ref's dtype."""
    fits = refs["fits"][...]
    start, nv = _chunk(refs, pb)            # (program ids outside pl.when: interpret mode)
    i0 = pl.program_id(2) * SUB
    rs, nvI = start + i0, nv - i0
    names = list(mats)

    @pl.when(jnp.min(fits) == 0)
    def _():
        ii, jj = jnp.arange(SUB)[:, None], jnp.arange(SUB)[None, :]

        def kblock(c, acc):
            c0 = c * bk
            fit = refs["fits"][c]
            xs = [ptr.load_block(refs[mats[n][0]], rs, SUB, nvI, c0, bk, pb.K).astype(F32)
                  for n in names]
            loc, _ = gt.cumsum(ptr.load_block(refs["g"], rs, SUB, nvI, c0, bk, pb.K))

            def body(j, carry):
                *ms, r = carry
                ok = j < nvI
                r = gt.add(r, gt.split(_row(refs["g"], rs + j, ok, pb.K, c0, bk)))  # loc_j
                kj = _row(refs["k"], rs + j, ok, pb.K, c0, bk)
                d = jnp.where(ii == j, 1.0, gt.masked_exp(gt.gap(loc, gt.bcast(r)), ii > j))
                y = kj[None, :] * d
                at = (jj == j) & (fit == 0)
                return tuple(m + jnp.where(at, jnp.sum(x * y, axis=1)[:, None], 0.0)
                             for m, x in zip(ms, xs)) + (r,)

            return lax.fori_loop(0, SUB, body, acc + (gt.zero_cum(bk),))[:-1]

        z = tuple(jnp.zeros((SUB, SUB), F32) for _ in names)
        nk = pb.Kp // bk
        ms = blocks(nk, kblock, z)
        blk = (pl.ds(i0, SUB), pl.ds(i0, SUB))
        for n, m in zip(names, ms):
            keep = ii > jj if mats[n][1] else ii >= jj
            ref = refs[n]
            ref[blk] = (ref[blk].astype(F32) + jnp.where(keep, m, 0.0)).astype(ref.dtype)


DIAG_FIX_LAUNCH = Launch(None, None, 4, 1)


def diag_fix(pb, ins, scores, fits, bk, mats, name):
    """Runs diag_fix_kernel after a split scores kernel: ins, the scores kernel's inputs (q,
    k, g, varlen); scores {name: [slots, H, BT, BT] array} updated in place (mats as
    diag_fix_kernel's, same names); fits int32 [slots, H, Kp / bk]. Returns {name: array}."""
    blk = specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero)
    io = [(n + "_in", a, blk) for n, a in scores.items()]
    io.append(("fits", fits, specs.slot_vec(fits.shape[-1])))
    outs = [(n, jax.ShapeDtypeStruct(a.shape, a.dtype), blk) for n, a in scores.items()]
    return call(lambda refs: diag_fix_kernel(refs, pb, bk, mats),
                (pb.n_slots, pb.H, pb.bt // SUB), ins + io, outs, DIAG_FIX_LAUNCH, name,
                aliases={n + "_in": n for n in scores})


def _diag_scores(refs, pb, rs, nvI, q, k, gI, n_cols, col0, width=None, frame=(SUB, 0)):
    """A_II [SUB, SUB] fp32 of one sub-chunk: sum_c q_ic k_jc exp(loc_ic - loc_jc), j <= i,
    exact per pair (one column per loop step; k's rows read from refs['k'], `width` as _row).
    frame = (n, at): the block is returned inside a [SUB, n] tile at columns at .. at + SUB
    (zeros elsewhere; cumsum_scores writes whole score rows). Measured on an H100 (GLA bf16
    B=4 T=4096 H=16 K=V=128): this loop beats the _diag_fits dot here (forward 2.69 ms against
    3.91 ms through lax.cond; that dot was Precision.HIGHEST, Triton's FMA path on the GPU)."""
    ii = jnp.arange(SUB)[:, None]
    jj = jnp.arange(frame[0])[None, :]
    qf = q.astype(F32)
    loc = gI[0]
    if loc is None:
        assert frame == (SUB, 0)
        return jnp.where(ii >= jj, ptr.matmul(qf, k.astype(F32), (1, 1), lax.Precision.HIGHEST),
                         0.0)

    def body(j, A):
        kj = _row(refs["k"], rs + j, j < nvI, n_cols, col0, width)
        lj = gt.bcast(gt.row(loc, j))
        d = jnp.where(ii == j, 1.0, gt.masked_exp(gt.gap(loc, lj), ii > j))
        col = jnp.sum(qf * kj[None, :] * d, axis=1)
        return jnp.where(jj == frame[1] + j, col[:, None], A)

    return lax.fori_loop(0, SUB, body, jnp.zeros((SUB, frame[0]), F32))


def _scores(refs, pb, qs, ks, gs, rows, n_cols, col0, dt):
    """{(I, J): A_IJ [SUB, SUB] fp32} for J <= I (the chunk's causal scores by sub-chunk)."""
    A = {}
    nb = pb.bt // SUB
    for I in range(nb):
        qf = _q_factor(pb, qs[I], gs[I]).astype(dt)
        for J in range(I):
            kf = _k_factor(pb, ks[J], gs[I], gs[J]).astype(dt)
            A[I, J] = ptr.matmul(qf, kf, (1, 1), pb.precision)
        A[I, I] = _diag_scores(refs, pb, rows[I][0], rows[I][1], qs[I], ks[I], gs[I], n_cols,
                               col0)
    return A


def _load_sub(refs, name, rows, n_cols, col0=0):
    return [ptr.load_rows(refs[name], rs, SUB, nv, n_cols, col0) for rs, nv in rows]


def _sub_rows(pb, start, nv):
    return [(start + I * SUB, nv - I * SUB) for I in range(pb.bt // SUB)]


# ----------------------------------------------------------------------------- forward
def _fwd_kernel(refs, pb, bv):
    c0 = pl.program_id(2) * bv
    start, nv = _chunk(refs, pb)
    rows = _sub_rows(pb, start, nv)
    qs = _load_sub(refs, "q", rows, pb.K)
    vs = _load_sub(refs, "v", rows, pb.V, c0)
    dt = qs[0].dtype
    gs, _ = _sub_gates(refs, pb, start, nv, pb.Kp, pb.K, 0)
    if "A" in refs:
        # precomputed scores (zero above the diagonal), read by sub-chunk blocks
        A = {(I, J): refs["A"][pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)]
             for I in range(pb.bt // SUB) for J in range(I + 1)}
    else:
        ks = _load_sub(refs, "k", rows, pb.K)
        A = _scores(refs, pb, qs, ks, gs, rows, pb.K, 0, dt)
    S = refs["h"][...].astype(dt)
    for I in range(pb.bt // SUB):
        qd = qs[I] if gs[I][0] is None else (
            qs[I] * jnp.exp(gs[I][0].value() + gt.bcast(gs[I][1]).value())).astype(dt)
        o = ptr.matmul(qd, S, (1, 0), pb.precision)
        for J in range(I + 1):
            o = o + ptr.matmul(A[I, J].astype(dt), vs[J], (1, 0), pb.precision)
        ptr.store_rows(refs["o"], rows[I][0], rows[I][1], pb.V, o * pb.scale, c0)


def _fwd_given_kernel(refs, pb, bv):
    """o = scale (qg S + A v) of one chunk and V block, qg = q exp(b) and A given
    (cumsum_scores): two dots, no gate work."""
    c0 = pl.program_id(2) * bv
    start, nv = _chunk(refs, pb)
    qg = ptr.load_rows(refs["qg"], start, pb.bt, nv, pb.K)
    v = ptr.load_rows(refs["v"], start, pb.bt, nv, pb.V, c0)
    dt = qg.dtype
    o = ptr.matmul(qg, refs["h"][...].astype(dt), (1, 0), pb.precision)
    o = o + ptr.matmul(refs["A"][...].astype(dt), v, (1, 0), pb.precision)
    ptr.store_rows(refs["o"], start, nv, pb.V, o * pb.scale, c0)


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


def output_fwd(pb: Problem, q, k, v, g, h, cu, seq, launch: Launch | None = None, A=None,
               qg=None):
    """o [B, T, H, V] in q's dtype from q, k [B, T, H, K], v [B, T, H, V], g (gate switch),
    h [slots, H, Kp, Vp] (state_pass_fwd), cu / seq (varlen: cu_seqlens int32 [N+1] and
    varlen.slot_sequences; else None). A: None (the scores are formed here from q, k, g) or
    the causal scores [slots, H, BT, BT] (fp32 or q's dtype; zero above the diagonal; k is
    then unused), as Triton's output stage reads them (KDA's delta_scores forms them).
    qg: None, or q exp(b) [B, T, H, K] with A (both from cumsum_scores): o = scale (qg h + A v),
    no gate work (q, k, g unused; o in qg's dtype)."""
    if qg is not None:
        return _output_fwd_given(pb, qg, v, h, A, cu, seq, launch)
    launch = launch or launch_for("output_fwd", pb.K, pb.V, q.dtype)
    bv = width(pb.Vp, launch.bv)
    par = dict(parallel=True)
    ins = [("q", q, specs.seq_rows(pb, pb.Kp, specs.zero, **par))]
    if A is None:
        ins.append(("k", k, specs.seq_rows(pb, pb.Kp, specs.zero, **par)))
    else:
        ins.append(("A", A, specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero)))
    ins += [("v", v, specs.seq_rows(pb, bv, specs.same, **par))]
    ins += _gate_input(pb, g, pb.Kp, specs.zero) + _parallel_inputs(pb, cu, seq)
    ins.append(("h", h, specs.slot_state(pb.Kp, bv, specs.zero, specs.same)))
    outs = [("o", jax.ShapeDtypeStruct(v.shape, q.dtype), specs.seq_rows(pb, bv, specs.same, **par))]
    r = call(lambda refs: _fwd_kernel(refs, pb, bv), _grid(pb, pl.cdiv(pb.V, bv)), ins, outs,
             launch, "engine_output_fwd")
    return r["o"]


def _output_fwd_given(pb, qg, v, h, A, cu, seq, launch):
    launch = launch or launch_for("output_fwd", pb.K, pb.V, qg.dtype)
    bv = width(pb.Vp, launch.bv)
    par = dict(parallel=True)
    ins = [("qg", qg, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("A", A, specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero)),
           ("v", v, specs.seq_rows(pb, bv, specs.same, **par))]
    ins += _parallel_inputs(pb, cu, seq)
    ins.append(("h", h, specs.slot_state(pb.Kp, bv, specs.zero, specs.same)))
    outs = [("o", jax.ShapeDtypeStruct(v.shape, qg.dtype),
             specs.seq_rows(pb, bv, specs.same, **par))]
    r = call(lambda refs: _fwd_given_kernel(refs, pb, bv), _grid(pb, pl.cdiv(pb.V, bv)), ins,
             outs, launch, "engine_output_fwd_given")
    return r["o"]


# ----------------------------------------------------------------------------- backward
def _dv_kernel(refs, pb, bv):
    c0 = pl.program_id(2) * bv
    start, nv = _chunk(refs, pb)
    rows = _sub_rows(pb, start, nv)
    qs = _load_sub(refs, "q", rows, pb.K)
    ks = _load_sub(refs, "k", rows, pb.K)
    dos = _load_sub(refs, "do", rows, pb.V, c0)
    dt = qs[0].dtype
    gs, tot = _sub_gates(refs, pb, start, nv, pb.Kp, pb.K, 0)
    A = _scores(refs, pb, qs, ks, gs, rows, pb.K, 0, dt)
    dS = refs["dh"][...].astype(dt)
    nb = pb.bt // SUB
    for J in range(nb):
        kd = ks[J] if gs[J][0] is None else (ks[J] * jnp.exp(gt.span(tot, gs[J][1], gs[J][0]))).astype(dt)
        dv = ptr.matmul(kd, dS, (1, 0), pb.precision)
        intra = None
        for I in range(J, nb):
            t = ptr.matmul(A[I, J].astype(dt), dos[I], (0, 0), pb.precision)
            intra = t if intra is None else intra + t
        ptr.store_rows(refs["dv"], rows[J][0], rows[J][1], pb.V, dv + pb.scale * intra, c0)


def _diag_grads(refs, pb, rs, nvI, q, k, gI, dA, n_cols, col0, want_dk=True):
    """Strict (i > j) in-sub-chunk parts of dq and dk [SUB, w] fp32:
    dq_i = sum_{j<i} dA_ij k_j exp(loc_i - loc_j), dk_j = sum_{i>j} dA_ij q_i exp(loc_i - loc_j);
    two fp32-accurate dots through the sub-chunk's start when _diag_fits, else per pair.
    want_dk=False: (dq, None)."""
    ii = jnp.arange(SUB)[:, None]
    jj = jnp.arange(SUB)[None, :]
    qf = q.astype(F32)
    loc = gI[0]
    w = q.shape[1]
    hi = lax.Precision.HIGHEST
    strict = jnp.where(ii > jj, dA, 0.0)
    if loc is None:
        return (ptr.matmul(strict, k.astype(F32), (1, 0), hi),
                ptr.matmul(strict, qf, (0, 0), hi) if want_dk else None)

    def body(j, carry):
        dq, dk = carry
        kj = _row(refs["k"], rs + j, j < nvI, n_cols, col0)
        a = jnp.sum(jnp.where(jj == j, dA, 0.0), axis=1)
        d = gt.masked_exp(gt.gap(loc, gt.bcast(gt.row(loc, j))), ii > j)
        wgt = a[:, None] * d
        dq = dq + wgt * kj[None, :]
        if want_dk:
            dkj = jnp.sum(wgt * qf, axis=0)
            dk = dk + jnp.where(ii == j, dkj[None, :], 0.0)
        return dq, dk

    def fast(_):
        e = jnp.exp(loc.value())
        return (e * ptr.matmul(strict, k.astype(F32) / e, (1, 0), hi),
                ptr.matmul(strict, qf * e, (0, 0), hi) / e if want_dk else z)

    z = jnp.zeros((SUB, w), F32)
    dq, dk = lax.cond(_diag_fits(loc), fast, lambda _: lax.fori_loop(0, SUB, body, (z, z)), 0)
    return dq, (dk if want_dk else None)


def _cross_q(q, gI, dt):
    """Query side of the cross-sub-chunk dk products: (q_i exp(loc_i - loc_0) in dt, exp(loc_0)
    [1, w] fp32, exp(loc_i) [SUB, w] fp32). Relative to the sub-chunk's first row the 16-bit
    operand keeps its leading row exact: q exp(loc) itself falls into fp16's subnormal range
    under gates below about -10 per token, and dg then loses the pair that crosses the
    sub-chunk boundary."""
    if gI[0] is None:
        return q, 1.0, 1.0
    loc = gI[0]
    first = gt.bcast(gt.row(loc, 0))
    return ((q * jnp.exp(gt.gap(loc, first))).astype(dt), jnp.exp(first.value()),
            jnp.exp(loc.value()))


def _cross_k(k, gJ, gJ1, dt):
    """Key side of the cross-sub-chunk dq products of sub-chunk J (for every later I):
    (k_j exp(b_endJ - b_j) in dt, its last row exact; exp(b_endJ - b_j) [SUB, w] fp32) with
    b_endJ = R_{J+1} (gJ1's start). The gap from b_endJ to R_I is applied per pair in fp32."""
    if gJ[0] is None:
        return k, 1.0
    e = jnp.exp(gt.span(gJ1[1], gJ[1], gJ[0]))
    return (k * e).astype(dt), e


def _between(gI, gJ1):
    """exp(R_I - R_{J+1}) [1, w] fp32: the decay from the end of sub-chunk J to the start of I."""
    if gI[0] is None:
        return 1.0
    return jnp.exp(gt.gap(gI[1], gJ1[1]))[None, :]


def _dqk_kernel(refs, pb, bk, dq_only=False):
    """dq, dk, dg of one chunk and K block; dq_only: dq alone (no dh input, no dk / dg)."""
    r0 = pl.program_id(2) * bk
    start, nv = _chunk(refs, pb)
    rows = _sub_rows(pb, start, nv)
    nb = pb.bt // SUB
    qs = _load_sub(refs, "q", rows, pb.K, r0)
    ks = _load_sub(refs, "k", rows, pb.K, r0)
    vs = _load_sub(refs, "v", rows, pb.V)
    dos = _load_sub(refs, "do", rows, pb.V)
    dt = qs[0].dtype
    gated = _gated(pb)
    gs, tot = _sub_gates(refs, pb, start, nv, bk, pb.K, r0)
    S32 = refs["h"][...].astype(F32)
    S = S32.astype(dt)
    if not dq_only:
        dS32 = refs["dh"][...].astype(F32)
        dS = dS32.astype(dt)
    ii = jnp.arange(SUB)[:, None]
    eye = ii == jnp.arange(SUB)[None, :]

    dA = {(I, J): pb.scale * ptr.matmul(dos[I], vs[J], (1, 1), pb.precision)
          for I in range(nb) for J in range(I + 1)}
    dq_inter, dk_inter, dq_strict, dk_strict = [], [], [], []
    for I in range(nb):
        x = ptr.matmul(dos[I], S, (1, 1), pb.precision)
        if gated:
            x = x * jnp.exp(gs[I][0].value() + gt.bcast(gs[I][1]).value())
        dq_inter.append(pb.scale * x)
        if not dq_only:
            y = ptr.matmul(vs[I], dS, (1, 1), pb.precision)
            if gated:
                y = y * jnp.exp(gt.span(tot, gs[I][1], gs[I][0]))
            dk_inter.append(y)
        dq, dk = _diag_grads(refs, pb, rows[I][0], rows[I][1], qs[I], ks[I], gs[I], dA[I, I],
                             pb.K, r0, want_dk=not dq_only)
        dq_strict.append(dq)
        dk_strict.append(dk)
    cross_k = [_cross_k(ks[J], gs[J], gs[J + 1], dt) for J in range(nb - 1)]
    for I in range(nb):
        q_rel, q_top, qloc = _cross_q(qs[I], gs[I], dt)
        for J in range(I):
            dAd = dA[I, J].astype(dt)
            k_rel, k_end = cross_k[J]
            between = _between(gs[I], gs[J + 1])
            dq_strict[I] = dq_strict[I] + (qloc * between) * ptr.matmul(dAd, k_rel, (1, 0),
                                                                        pb.precision)
            if not dq_only:
                dk_strict[J] = dk_strict[J] + (k_end * (between * q_top)) * ptr.matmul(
                    dAd, q_rel, (0, 0), pb.precision)
    if dq_only:
        for I in range(nb):
            rs, nvI = rows[I]
            ddiag = jnp.sum(jnp.where(eye, dA[I, I], 0.0), axis=1)[:, None]
            ptr.store_rows(refs["dq"], rs, nvI, pb.K, dq_inter[I] + dq_strict[I] + ddiag * ks[I],
                           r0)
        return

    if gated:
        rowterm = jnp.exp(tot.value()) * jnp.sum(S32 * dS32, axis=1)
        y_tot = [jnp.sum(qs[I] * (dq_inter[I] + dq_strict[I]) - ks[I] * dk_strict[I], axis=0)
                 for I in range(nb)]
        later = jnp.zeros_like(rowterm)
        suffix = [None] * nb
        for I in reversed(range(nb)):
            suffix[I] = later
            later = later + y_tot[I]
        before = jnp.zeros_like(rowterm)
    for I in range(nb):
        rs, nvI = rows[I]
        ddiag = jnp.sum(jnp.where(eye, dA[I, I], 0.0), axis=1)[:, None]
        dq = dq_inter[I] + dq_strict[I] + ddiag * ks[I]
        dk = dk_inter[I] + dk_strict[I] + ddiag * qs[I]
        ptr.store_rows(refs["dq"], rs, nvI, pb.K, dq, r0)
        ptr.store_rows(refs["dk"], rs, nvI, pb.K, dk, r0)
        if not gated:
            continue
        yv = qs[I] * (dq_inter[I] + dq_strict[I]) - ks[I] * dk_strict[I]
        ki = jnp.where(ii == nvI - 1, 0.0, ks[I] * dk_inter[I])
        suf = suffix[I][None, :] + (jnp.sum(yv, axis=0)[None, :] - jnp.cumsum(yv, axis=0) + yv)
        pre = before[None, :] + (jnp.cumsum(ki, axis=0) - ki)
        before = before + jnp.sum(ki, axis=0)
        dg = suf + pre + rowterm[None, :]
        if pb.gate == gt.GATE_KEY:
            ptr.store_rows(refs["dg"], rs, nvI, pb.K, dg, r0)
        else:
            ptr.store_rows(refs["dg"], rs, nvI, None, jnp.sum(dg, axis=1))


def output_dq(pb: Problem, q, k, v, g, h, do, cu, seq, launch: Launch | None = None):
    """The dq of output_bwd alone (q's dtype), without dh: the one cotangent that does not
    depend on the states' gradients (GSA's slot pass takes its output from it)."""
    launch = launch or launch_for("output_dqk", pb.K, pb.V, q.dtype)
    bk = width(pb.Kp, launch.bk)
    par = dict(parallel=True)
    ins = [("q", q, specs.seq_rows(pb, bk, specs.same, **par)),
           ("k", k, specs.seq_rows(pb, bk, specs.same, **par)),
           ("v", v, specs.seq_rows(pb, pb.Vp, specs.zero, **par)),
           ("do", do, specs.seq_rows(pb, pb.Vp, specs.zero, **par))]
    ins += _gate_input(pb, g, bk, specs.same) + _parallel_inputs(pb, cu, seq)
    ins.append(("h", h, specs.slot_state(bk, pb.Vp, specs.same, specs.zero)))
    outs = [("dq", jax.ShapeDtypeStruct(q.shape, q.dtype),
             specs.seq_rows(pb, bk, specs.same, **par))]
    r = call(lambda refs: _dqk_kernel(refs, pb, bk, dq_only=True),
             _grid(pb, pl.cdiv(pb.K, bk)), ins, outs, launch, "engine_output_dq")
    return r["dq"]


def _output_dv(pb, q, k, v, g, do, dh, common, launch_dv):
    par = dict(parallel=True)
    bv = width(pb.Vp, launch_dv.bv)
    ins = [("q", q, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("k", k, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("do", do, specs.seq_rows(pb, bv, specs.same, **par))]
    ins += _gate_input(pb, g, pb.Kp, specs.zero) + common
    ins.append(("dh", dh, specs.slot_state(pb.Kp, bv, specs.zero, specs.same)))
    outs = [("dv", jax.ShapeDtypeStruct(v.shape, v.dtype), specs.seq_rows(pb, bv, specs.same, **par))]
    return call(lambda refs: _dv_kernel(refs, pb, bv), _grid(pb, pl.cdiv(pb.V, bv)), ins, outs,
                launch_dv, "engine_output_dv")["dv"]


def _dqk_outputs(pb, q, k, g, bk, nkb, dk_dtype):
    """Outputs of a dq / dk / dg kernel on grid (slots, H, nkb): dq, dk ([B, T, H, K], K
    blocks of bk; dk in dk_dtype or k's) and dg: fp32 [B, T, H, K] (key gate), one partial
    [B, T, H] per K block (scalar gate, summed by _dqk_dg) or none."""
    par = dict(parallel=True)
    rows = specs.seq_rows(pb, bk, specs.same, **par)
    outs = [("dq", jax.ShapeDtypeStruct(q.shape, q.dtype), rows),
            ("dk", jax.ShapeDtypeStruct(k.shape, dk_dtype or k.dtype), rows)]
    if pb.gate == gt.GATE_KEY:
        outs.append(("dg", jax.ShapeDtypeStruct(g.shape, F32), rows))
    elif pb.gate == gt.GATE_SCALAR:
        part = jax.ShapeDtypeStruct((nkb,) + g.shape, F32)
        batch = vl.batch_of_slot(pb.varlen, pb.T, pb.bt)
        outs.append(("dg", part, pl.BlockSpec((None, None, pb.T, None),
                                              lambda s, hh, j: (j, batch(s), 0, hh))))
    return outs


def _dqk_dg(pb, r):
    """dg from the kernel results r (None without a gate)."""
    dg = r.get("dg")
    return jnp.sum(dg, axis=0) if pb.gate == gt.GATE_SCALAR else dg


def output_bwd(pb: Problem, q, k, v, g, h, do, dh, cu, seq,
               launch_dv: Launch | None = None, launch_dqk: Launch | None = None,
               dk_dtype=None, want_dv=True):
    """Cotangents of output_fwd w.r.t. q, k, v (their dtypes) and the gate (fp32: [B, T, H, K]
    for GATE_KEY, [B, T, H] for GATE_SCALAR, None for GATE_NONE), from do [B, T, H, V] and
    dh [slots, H, Kp, Vp] (state_pass_bwd). dv also carries the state path (k dS).
    dk_dtype: dk's dtype when not k's (KDA adds fp32 terms to it before rounding).
    want_dv=False: dv is None and its kernel is not called (KDA's state pass forms it)."""
    launch_dv = launch_dv or launch_for("output_dv", pb.K, pb.V, q.dtype)
    launch_dqk = launch_dqk or launch_for("output_dqk", pb.K, pb.V, q.dtype)
    par = dict(parallel=True)
    common = _parallel_inputs(pb, cu, seq)

    dv = _output_dv(pb, q, k, v, g, do, dh, common, launch_dv) if want_dv else None

    bk = width(pb.Kp, launch_dqk.bk)
    nkb = pl.cdiv(pb.K, bk)
    ins = [("q", q, specs.seq_rows(pb, bk, specs.same, **par)),
           ("k", k, specs.seq_rows(pb, bk, specs.same, **par)),
           ("v", v, specs.seq_rows(pb, pb.Vp, specs.zero, **par)),
           ("do", do, specs.seq_rows(pb, pb.Vp, specs.zero, **par))]
    ins += _gate_input(pb, g, bk, specs.same) + common
    ins += [("h", h, specs.slot_state(bk, pb.Vp, specs.same, specs.zero)),
            ("dh", dh, specs.slot_state(bk, pb.Vp, specs.same, specs.zero))]
    outs = _dqk_outputs(pb, q, k, g, bk, nkb, dk_dtype)
    r = call(lambda refs: _dqk_kernel(refs, pb, bk), _grid(pb, nkb), ins, outs, launch_dqk,
             "engine_output_dqk")
    return r["dq"], r["dk"], dv, _dqk_dg(pb, r)
