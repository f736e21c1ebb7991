"""Intra-chunk scores of the per-key-gated delta rule (Pallas, Triton lowering): the mirror of
fla_torch/ops/common/engine/delta_scores.py.

    Aqk_ij = sum_c q_ic k_jc exp(b_ic - b_jc)   (j <= i)
    Ak_ij  = sum_c k_ic k_jc exp(b_ic - b_jc)   (j < i)
    kb     = k exp(b - b_0)                     (relative to the chunk's first row)
    qg     = q exp(b)                           (the output stage's query, every exponent <= 0)
    kg     = k exp(last - b), e0 = exp(b_0), el = exp(last)   (the state pass's, as delta_prep)
b the in-chunk inclusive cumsum of the per-key log-decay, split hi + lo (gates.cumsum), b_0
its value at the chunk's first row. Both matrices are formed by sub-chunks of SUB = 16 rows:
pairs of different sub-chunks through the later sub-chunk I's start R_I (query side
x_i exp(b_i - R_I), key side k_j exp(R_I - b_j), every exponent <= 0), the key factor shared
by both matrices; pairs inside a sub-chunk in fp32, exactly per pair or (FRAME "chunk") as one
fp32-accurate dot where the decay allows.
FRAME (or delta_scores(frame=...)) picks the kernel; the results agree to fp32 rounding:
  "rows": one program per (chunk slot, head, sub-chunk I) writing rows I (SPLIT; the earlier
    sub-chunks' keys and gates re-read in lax.fori_loops, as Triton's delta_scores), or with
    SPLIT = False one per (chunk slot, head); [SUB, SUB] dots, whole Kp at once, the diagonal
    blocks always exact per pair (_diag_pair, 16 column steps).
  "chunk": one program per (chunk slot, head), key channels in blocks of `bk` (the scores
    summed over them, as cumsum_scores' FRAME "chunk"): per sub-chunk I one [BT, BT] dot for
    each matrix (query / key rows masked to sub-chunk I, keys to the earlier sub-chunks); the
    diagonal blocks of all sub-chunks in one fp32-accurate dot per matrix, kept when the decay
    across every sub-chunk stays under gates.SPAN in the key block (_diag_fits); where it does
    not, DIAG "split" (the default) adds the exact per-pair blocks in a second kernel
    (output_stage.diag_fix_kernel, from the key-block flags the scores kernel writes), DIAG
    "cond" forms them in the kernel (a SUB-step loop under lax.cond).
kb is kept relative to the chunk's first row in every dtype (the Triton `rel` variant): exp(b)
of strong gates is subnormal in fp16, and exp(b_0) is applied in fp32 by the users of kb / w
(the state pass, the WY backward).
Shapes: q, k [B, T, H, K] (one dtype), g [B, T, H, K] fp32; outputs Aqk, Ak
[slots, H, BT, BT] fp32 (zero above the diagonal; Ak's diagonal zero; every entry of every
slot written, unused varlen slots zeros), kb, qg [B, T, H, K] in k's dtype (rows past a
sequence's end not written). Rows past the chunk's valid rows read q = k = g = 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from . import gates as gt
from . import specs
from .delta_prep import delta_prep_fwd
from .launch import SUB, Launch, Problem, blocks, call
from .output_stage import (_chunk, _diag_fits, _k_factor, _load_sub, _parallel_inputs, _q_factor,
                           _row, _sub_gates, _sub_rows, diag_fix)

F32 = jnp.float32
LAUNCH = Launch(None, None, 4, 1)
FRAMES = ("rows", "chunk")
FRAME = "chunk"     # "rows": _sub_kernel / _kernel ([SUB, SUB] dots); "chunk": _chunk_kernel
# FRAME "rows" only: True: one program per (chunk slot, head, sub-chunk) (_sub_kernel, as
# Triton's); False: one per (chunk slot, head) (_kernel). The same numbers either way.
# H100, KDA bf16 B4 T4096 H16 K=V=128: rows + SPLIT 1.83 ms.
SPLIT = True
BK = 64             # FRAME "chunk": key block width (cumsum_scores' GLA timing: 64 beats 32)
# FRAME "chunk": how the diagonal [SUB, SUB] blocks are formed.
#   "split": the scores kernel forms every key block's diagonal blocks as one fp32-accurate
#     dot (no branch), kept where the key block's decay fits (_diag_fits), and writes that flag
#     per key block (`fits`, also read by the backward's intra kernels); a second kernel
#     (output_stage.diag_fix_kernel: one program per sub-chunk, [SUB, BK] tiles, nothing done
#     where every key block fits) adds, in place, the exact per-pair blocks of the key blocks
#     that do not. H100 bf16 K=128 (session 12): the scores kernel without diagonal work
#     0.475 ms, with the loop beside the dot under lax.cond 0.977 (the tile maximum itself
#     costs ~0: formed outside the kernel the total did not drop), the exact blocks of every
#     key block in the second kernel 0.77.
#   "cond": in the scores kernel, the dot where the decay fits (tested on the cumsum), else per
#     pair, under lax.cond.
DIAGS = ("split", "cond")
FIX = {"Aqk": ("q", False), "Ak": ("k", True)}     # diag_fix_kernel's matrices
DIAG = "split"


def chunk_b(gs):
    """[Cum b of sub-chunk I ([SUB, w])] from output_stage._sub_gates' (loc_I, R_I) pairs."""
    return [gt.Cum(loc.hi + R.hi[None, :], loc.lo + R.lo[None, :]) for loc, R in gs]


def rel_exp(bI: gt.Cum, b0: gt.Cum):
    """exp(b - b_0) [SUB, w] fp32 for the [SUB, w] Cum bI and the [w] Cum b0 (exponent <= 0)."""
    return jnp.exp(gt.gap(bI, gt.bcast(b0)))


def store_blocks(ref, A, nb, strict):
    """A {(I, J): [SUB, SUB]} (J <= I) into the [nb*SUB, nb*SUB] ref; zero above the diagonal
    (strict: the diagonal too)."""
    ii = jnp.arange(SUB)[:, None]
    jj = jnp.arange(SUB)[None, :]
    z = jnp.zeros((SUB, SUB), F32)
    for I in range(nb):
        for J in range(nb):
            if J < I:
                x = A[I, J]
            elif J == I:
                x = jnp.where(ii > jj if strict else ii >= jj, A[I, I], 0.0)
            else:
                x = z
            ref[pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)] = x


def _diag_pair(refs, rs, nvI, q, k, loc, n_cols):
    """(Aqk_II, Ak_II) [SUB, SUB] fp32 of one sub-chunk, exact per pair (j <= i; one column
    per loop step, the key row read from refs['k']), both from one decay factor."""
    ii = jnp.arange(SUB)[:, None]
    jj = jnp.arange(SUB)[None, :]
    qf, kf = q.astype(F32), k.astype(F32)

    def body(j, acc):
        aq, ak = acc
        kj = _row(refs["k"], rs + j, j < nvI, n_cols, 0)
        d = jnp.where(ii == j, 1.0, gt.masked_exp(gt.gap(loc, gt.bcast(gt.row(loc, j))), ii > j))
        x = kj[None, :] * d
        return (jnp.where(jj == j, jnp.sum(qf * x, axis=1)[:, None], aq),
                jnp.where(jj == j, jnp.sum(kf * x, axis=1)[:, None], ak))

    z = jnp.zeros((SUB, SUB), F32)
    return lax.fori_loop(0, SUB, body, (z, z))


def _scores2(refs, pb, qs, ks, gs, rows, dt):
    """({(I, J): Aqk_IJ}, {(I, J): Ak_IJ}) [SUB, SUB] fp32 for J <= I: pairs of different
    sub-chunks through sub-chunk I's start (one dot each, the key factor shared)."""
    Aq, Ak = {}, {}
    for I in range(pb.bt // SUB):
        qf = _q_factor(pb, qs[I], gs[I]).astype(dt)
        kf = _q_factor(pb, ks[I], gs[I]).astype(dt)
        for J in range(I):
            kc = _k_factor(pb, ks[J], gs[I], gs[J]).astype(dt)
            Aq[I, J] = ptr.matmul(qf, kc, (1, 1), pb.precision)
            Ak[I, J] = ptr.matmul(kf, kc, (1, 1), pb.precision)
        Aq[I, I], Ak[I, I] = _diag_pair(refs, rows[I][0], rows[I][1], qs[I], ks[I], gs[I][0],
                                        pb.K)
    return Aq, Ak


def _kernel(refs, pb):
    start, nv = _chunk(refs, pb)
    rows = _sub_rows(pb, start, nv)
    nb = pb.bt // SUB
    qs = _load_sub(refs, "q", rows, pb.K)
    ks = _load_sub(refs, "k", rows, pb.K)
    dt = qs[0].dtype
    gs, _ = _sub_gates(refs, pb, start, nv, pb.Kp, pb.K, 0)
    Aq, Ak = _scores2(refs, pb, qs, ks, gs, rows, dt)
    store_blocks(refs["Aqk"], Aq, nb, False)
    store_blocks(refs["Ak"], Ak, nb, True)
    bs = chunk_b(gs)
    b0 = gt.row(gs[0][0], 0)
    for I in range(nb):
        ptr.store_rows(refs["kb"], rows[I][0], rows[I][1], pb.K, ks[I] * rel_exp(bs[I], b0))
        ptr.store_rows(refs["qg"], rows[I][0], rows[I][1], pb.K, qs[I] * jnp.exp(bs[I].value()))


def _gate_sub(refs, pb, rs, n_valid):
    """(loc [SUB, Kp] Cum, total [Kp] Cum) of the sub-chunk whose first row is rs."""
    return gt.cumsum(gt.load_gate(refs["g"], gt.GATE_KEY, rs, SUB, n_valid, pb.Kp, pb.K))


def _sub_kernel(refs, pb):
    """One program per (chunk slot, head, sub-chunk I): rows I*SUB.. of Aqk, Ak and kb (the
    earlier sub-chunks' keys and gates re-read in lax.fori_loops: fewer values live at once
    than in _kernel, as Triton's delta_scores)."""
    I = pl.program_id(2)
    nb = pb.bt // SUB
    start, nv = _chunk(refs, pb)
    i0 = I * SUB
    rs, nvI = start + i0, nv - i0
    q = ptr.load_rows(refs["q"], rs, SUB, nvI, pb.K)
    k = ptr.load_rows(refs["k"], rs, SUB, nvI, pb.K)
    dt = q.dtype
    loc, _ = _gate_sub(refs, pb, rs, nvI)
    b0 = gt.row(_gate_sub(refs, pb, start, nv)[0], 0)

    def total(J, R):
        return gt.add(R, _gate_sub(refs, pb, start + J * SUB, nv - J * SUB)[1])

    R = lax.fori_loop(0, I, total, gt.zero_cum(pb.Kp))
    el = jnp.exp(loc.value())
    qf, kf = (q * el).astype(dt), (k * el).astype(dt)

    def block(J, RJ):
        rJ, nvJ = start + J * SUB, nv - J * SUB
        kJ = ptr.load_rows(refs["k"], rJ, SUB, nvJ, pb.K)
        locJ, totJ = _gate_sub(refs, pb, rJ, nvJ)
        kc = (kJ * jnp.exp(gt.span(R, RJ, locJ))).astype(dt)
        cols = pl.ds(J * SUB, SUB)
        refs["Aqk"][pl.ds(i0, SUB), cols] = ptr.matmul(qf, kc, (1, 1), pb.precision)
        refs["Ak"][pl.ds(i0, SUB), cols] = ptr.matmul(kf, kc, (1, 1), pb.precision)
        return gt.add(RJ, totJ)

    lax.fori_loop(0, I, block, gt.zero_cum(pb.Kp))
    aq, ak = _diag_pair(refs, rs, nvI, q, k, loc, pb.K)
    ii = jnp.arange(SUB)[:, None]
    jj = jnp.arange(SUB)[None, :]
    refs["Aqk"][pl.ds(i0, SUB), pl.ds(i0, SUB)] = jnp.where(ii >= jj, aq, 0.0)
    refs["Ak"][pl.ds(i0, SUB), pl.ds(i0, SUB)] = jnp.where(ii > jj, ak, 0.0)

    def zero(J, c):
        z = jnp.zeros((SUB, SUB), F32)
        refs["Aqk"][pl.ds(i0, SUB), pl.ds(J * SUB, SUB)] = z
        refs["Ak"][pl.ds(i0, SUB), pl.ds(J * SUB, SUB)] = z
        return c

    lax.fori_loop(I + 1, nb, zero, 0)
    bI = gt.Cum(loc.hi + R.hi[None, :], loc.lo + R.lo[None, :])
    ptr.store_rows(refs["kb"], rs, nvI, pb.K, k * rel_exp(bI, b0))
    ptr.store_rows(refs["qg"], rs, nvI, pb.K, q * jnp.exp(bI.value()))


def _chunk_diag(refs, pb, c0, bk, start, nv, q, k, loc, eloc, split=False):
    """FRAME "chunk": the diagonal [SUB, SUB] blocks of all sub-chunks of one key block as
    (Aqk, Ak) [BT, BT] fp32 (zero outside them; Aqk ii >= jj, Ak ii > jj): one fp32-accurate
    dot per matrix through each sub-chunk's start when _diag_fits(loc) (factors exp(+-loc)
    within e^SPAN), else exact per pair in a SUB-step loop (step s: column s of every
    sub-chunk, its key rows read from refs['k']), both matrices from one decay factor; split
    (DIAG "split"): the dot alone, zero where it does not fit. Returns (Aqk, Ak, fits: traced
    bool, the decision either way). q, k [BT, bk]; loc [BT, bk] Cum (b less b before the row's sub-chunk), eloc =
    exp(loc) fp32."""
    bt = pb.bt
    ii, jj = jnp.arange(bt)[:, None], jnp.arange(bt)[None, :]
    same = ii // SUB == jj // SUB
    q32, k32 = q.astype(F32), k.astype(F32)

    def fast(_):
        ke = k32 * jnp.exp(-loc.value())        # in [1, e^SPAN) here
        half = q.dtype != F32
        return (ptr.accurate_matmul(q32 * eloc, ke, (1, 1), half),
                ptr.accurate_matmul(k32 * eloc, ke, (1, 1), half))

    def loop(_):
        # step s takes column j = I * SUB + s of every sub-chunk I at once (SUB steps, not BT)
        sub = ii // SUB

        def body(s, acc):
            aq, ak = acc
            j = sub * SUB + s                                     # [BT, 1]: each row's column
            kj = jnp.zeros((bt, bk), F32)
            lj = gt.Cum(kj, kj)
            for I in range(bt // SUB):
                t = I * SUB + s
                mine = sub == I
                kj = jnp.where(mine, _row(refs["k"], start + t, t < nv, pb.K, c0, bk)[None, :], kj)
                lt = gt.row(loc, t)
                lj = gt.Cum(jnp.where(mine, lt.hi[None, :], lj.hi),
                            jnp.where(mine, lt.lo[None, :], lj.lo))
            d = jnp.where(ii == j, 1.0, gt.masked_exp(gt.gap(loc, lj), ii > j))
            x = kj * d
            at = jj == j
            return (jnp.where(at, jnp.sum(q32 * x, axis=1)[:, None], aq),
                    jnp.where(at, jnp.sum(k32 * x, axis=1)[:, None], ak))

        z = jnp.zeros((bt, bt), F32)
        return lax.fori_loop(0, SUB, body, (z, z))

    ok = _diag_fits(loc)
    if split:   # DIAG "split": the dot alone, dropped where it does not fit (diag_fix_kernel's)
        (aq, ak), keep = fast(0), ok
    else:
        (aq, ak), keep = lax.cond(ok, fast, loop, 0), True
    return (jnp.where(same & (ii >= jj) & keep, aq, 0.0),
            jnp.where(same & (ii > jj) & keep, ak, 0.0), ok)


def _chunk_block(refs, pb, c0, bk, start, nv, split=False):
    """FRAME "chunk": one key block's part (columns c0 .. c0 + bk) of (Aqk, Ak) [BT, BT] fp32;
    stores kb's columns. Per sub-chunk I >= 1 one dot per matrix over the whole chunk: rows of
    I (q, resp. k, times exp(loc)) against the earlier sub-chunks' keys k_j exp(R_I - b_j)."""
    K, bt = pb.K, pb.bt
    b, tot = gt.cumsum(ptr.load_block(refs["g"], start, bt, nv, c0, bk, K))
    q = ptr.load_block(refs["q"], start, bt, nv, c0, bk, K)
    k = ptr.load_block(refs["k"], start, bt, nv, c0, bk, K)
    dt = q.dtype
    b0 = gt.row(b, 0)
    ptr.store_block(refs["kb"], start, nv, c0, K, (k * rel_exp(b, b0)).astype(dt))
    ptr.store_block(refs["qg"], start, nv, c0, K, (q * jnp.exp(b.value())).astype(dt))
    # the state pass's chunk-parallel inputs (delta_prep_fwd's kg, e0, el)
    ptr.store_block(refs["kg"], start, nv, c0, K,
                    (k * jnp.exp(gt.gap(gt.bcast(tot), b))).astype(dt))
    refs["e0"][pl.ds(c0, bk)] = jnp.exp(b0.value())
    refs["el"][pl.ds(c0, bk)] = jnp.exp(tot.value())
    Rs, loc = gt.sub_chunk_split(b, SUB)      # Rs[I]: b before sub-chunk I; loc = b - Rs[row's]
    eloc = jnp.exp(loc.value())
    qf, kf = (q * eloc).astype(dt), (k * eloc).astype(dt)
    sub = (jnp.arange(bt) // SUB)[:, None]
    aq, ak, ok = _chunk_diag(refs, pb, c0, bk, start, nv, q, k, loc, eloc, split)
    for I in range(1, bt // SUB):
        kd = (k * gt.masked_exp(gt.gap(gt.bcast(Rs[I]), b), sub < I)).astype(dt)
        aq = aq + ptr.matmul(jnp.where(sub == I, qf, 0.0).astype(dt), kd, (1, 1), pb.precision)
        ak = ak + ptr.matmul(jnp.where(sub == I, kf, 0.0).astype(dt), kd, (1, 1), pb.precision)
    return aq, ak, ok


def _chunk_kernel(refs, pb, bk, split):
    """FRAME "chunk": one program per (chunk slot, head); Aqk, Ak summed over the key blocks
    in fp32 and stored once (split, DIAG "split": with the diagonal blocks of the key blocks
    that fit only), and each key block's flag into refs['fits']."""
    start, nv = _chunk(refs, pb)
    nk = pb.Kp // bk

    def kblock(c, acc):
        aq, ak, ok = _chunk_block(refs, pb, c * bk, bk, start, nv, split)
        return acc[0] + aq, acc[1] + ak, jnp.where(jnp.arange(nk) == c, ok.astype(jnp.int32),
                                                   acc[2])

    z = jnp.zeros((pb.bt, pb.bt), F32)
    init = (z, z, jnp.ones((nk,), jnp.int32))
    aq, ak, fits = blocks(nk, kblock, init)
    refs["Aqk"][...] = aq
    refs["Ak"][...] = ak
    refs["fits"][...] = fits


def delta_scores(pb: Problem, q, k, g, cu, seq, frame=None, bk=None, diag=None,
                 with_fits=False):
    """(Aqk, Ak [slots, H, BT, BT] fp32, kb, qg [B, T, H, K] in k's dtype, and the state
    pass's kg [B, T, H, K] in k's dtype, e0, el [slots, H, Kp] fp32 (delta_prep_fwd's; the
    "chunk" frame forms them in the same program, "rows" calls delta_prep_fwd)) from q, k
    [B, T, H, K], the key gate g [B, T, H, K] fp32 and cu / seq (varlen: cu_seqlens int32
    [N+1] and varlen.slot_sequences; else None). frame: one of FRAMES (None: FRAME); bk: the
    key block of FRAME "chunk" (None: BK; a power of two >= 16, capped at Kp); diag: where
    FRAME "chunk" forms the diagonal blocks, one of DIAGS (None: DIAG). with_fits: also
    return (fits, bk): FRAME "chunk"'s flags int32 [slots, H, Kp / bk] (1 where the key
    block's decay across every sub-chunk stays under gates.SPAN; either DIAG), else None."""
    frame = FRAME if frame is None else frame
    bk = BK if bk is None else bk
    diag = DIAG if diag is None else diag
    if frame not in FRAMES:
        raise ValueError(f"delta_scores: frame={frame!r}; expected one of {FRAMES}")
    if diag not in DIAGS:
        raise ValueError(f"delta_scores: diag={diag!r}; expected one of {DIAGS}")
    if not isinstance(bk, int) or bk < 16 or bk & (bk - 1):
        raise ValueError(f"delta_scores: bk={bk!r}; expected a power of two >= 16")
    if q.dtype != k.dtype or g.dtype != F32:
        raise ValueError(f"delta_scores: q {q.dtype}, k {k.dtype}, g {g.dtype}; expected q and "
                         f"k of one dtype, g float32")
    par = dict(parallel=True)
    ins = [("q", q, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("k", k, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("g", g, specs.seq_rows(pb, pb.Kp, specs.zero, **par))]
    ins += _parallel_inputs(pb, cu, seq)
    sq = jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.bt, pb.bt), F32)
    blk = specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero)
    outs = [("Aqk", sq, blk), ("Ak", sq, blk),
            ("kb", jax.ShapeDtypeStruct(k.shape, k.dtype),
             specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
            ("qg", jax.ShapeDtypeStruct(q.shape, q.dtype),
             specs.seq_rows(pb, pb.Kp, specs.zero, **par))]
    vec = jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp), F32)
    if frame == "chunk":
        outs += [("kg", jax.ShapeDtypeStruct(k.shape, k.dtype),
                  specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
                 ("e0", vec, specs.slot_vec(pb.Kp)), ("el", vec, specs.slot_vec(pb.Kp))]
    if frame == "chunk":
        kern = functools.partial(_chunk_kernel, bk=min(bk, pb.Kp), split=diag == "split")
        nprog, nk = 1, pb.Kp // min(bk, pb.Kp)
        outs.append(("fits", jax.ShapeDtypeStruct((pb.n_slots, pb.H, nk), jnp.int32),
                     specs.slot_vec(nk)))
    else:
        kern, nprog = (_sub_kernel, pb.bt // SUB) if SPLIT else (_kernel, 1)
    r = call(lambda refs: kern(refs, pb), (pb.n_slots, pb.H, nprog), ins, outs, LAUNCH,
             "kda_delta_scores")
    if frame == "chunk" and diag == "split":
        r = dict(r, **diag_fix(pb, ins, {"Aqk": r["Aqk"], "Ak": r["Ak"]}, r["fits"],
                               min(bk, pb.Kp), FIX, "kda_delta_scores_fix"))
    if frame == "chunk":
        kg, e0, el = r["kg"], r["e0"], r["el"]
    else:
        kg, e0, el = delta_prep_fwd(pb, k, g, cu, seq)
    out = r["Aqk"], r["Ak"], r["kb"], r["qg"], kg, e0, el
    if with_fits:
        out += ((r["fits"], min(bk, pb.Kp)) if "fits" in r else None,)
    return out
