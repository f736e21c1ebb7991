"""Key-gate forward front stage (Pallas, Triton lowering): the mirror of
fla_torch/ops/common/engine/cumsum_scores.py. The gate cumsum of a chunk and its intra-chunk
scores in one program, so neither the state pass nor the output stage does gate work.

Per program (chunk slot, head; key channels in blocks of `bk`, the scores summed over them),
with b the in-chunk inclusive cumsum of the log-decay (split hi + lo, gates.py), `last` its
value at the chunk's end, R_I = b just before sub-chunk I and loc = b - R_I inside it:
    A_ij = sum_c q_ic k_jc exp(b_ic - b_jc)   (j <= i; 0 above the diagonal), formed in fp32
      earlier sub-chunks (J < I): (q_i exp(loc_i)) . (k_j exp(R_I - b_j)), every exponent
        <= 0, one dot per row block I against the whole chunk's keys (16-bit operands in q's
        dtype, pb.precision for fp32);
      the diagonal block of I: DIAG = "cond": (q_i exp(loc_i)) . (k_j exp(-loc_j)) as one
        fp32-accurate dot (3xTF32 on the GPU) when the decay across the sub-chunk stays under
        gates.SPAN in this key block (factors within e^SPAN: exact fp32 numbers, each pair's
        exponent error ~SPAN * 6e-8), else exact per pair (output_stage._diag_scores) under
        lax.cond; DIAG = "loop": always per pair.
    qg = q exp(b), kg = k exp(last - b)  [B, T, H, K] in q's dtype (rows past a sequence's
      end are not written; the output stage and the state pass mask them on load)
    el = exp(last)  [slots, H, Kp] fp32 (padded columns: 1)
A is written [slots, H, BT, BT] in q's dtype (the output stage rounds it to that for its dot
in any case; fp32 for fp32), every entry of every slot (unused varlen slots: zeros), so no
reader meets an unwritten value. Rows past the chunk's valid rows read q = k = g = 0.
Switches for GPU timing (the same results up to fp32 rounding in the diagonal blocks):
SPLIT: one program per (chunk slot, head, sub-chunk I) writing rows I of A and sub-chunk I of
qg / kg (the chunk's gates and keys re-read by each), instead of one per (chunk slot, head).
FRAME = "rows": the dots above per row block, [SUB, BT] results, the diagonal decision per
sub-chunk; "chunk": Triton's formulation, [BT, BT] dots (queries masked to row block I), the
diagonal blocks of all sub-chunks in one dot when all fit, else a BT-step per-pair loop.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from . import gates as gt
from . import specs
from .launch import SUB, Launch, Problem, blocks, call, launch_for
from .output_stage import _chunk, _diag_fits, _diag_scores, _parallel_inputs, _row, diag_fix

F32 = jnp.float32
DIAGS = ("cond", "loop", "split")
# diagonal sub-blocks: "split" (FRAME "chunk" only): the factored dot kept by the key block's
# flag (no branch), a second kernel (output_stage.diag_fix_kernel) adding exact blocks where a
# key block does not fit, as delta_scores' DIAG "split"; "cond": the factored dot under
# lax.cond(_diag_fits) else per pair; "loop": always per pair. FRAME "chunk" writes the flags
# with "cond" and "split" (the backward's intra kernel reads them). H100 GLA bf16 K=128
# (session 12): cond 0.555 ms, split 0.585 (its second kernel's launch); strong gates (every
# 7th channel -5.5 .. -15 per token) cond 4.216, split 1.336.
DIAG = "cond"
SPLIT = False       # True: one program per (chunk slot, head, sub-chunk) (FRAME "rows" only)
FRAMES = ("rows", "chunk")
FRAME = "chunk"     # "rows": [SUB, BT] dots per row block; "chunk": [BT, BT] ones (Triton's)
# H100, GLA bf16 B4 T4096 H16 K=V=128, session 10 (cond diagonal, 4 warps): chunk bk 64 0.543 ms,
# chunk bk 32 0.605, rows bk 32 0.944, rows bk 64 1.184, split (rows) bk 32 1.460; loop
# diagonals 2.4-3.9 ms; 8 warps slower


def _tile(ref, r0, rows, nv, c0, bk, n_cols):
    """ref[r0:r0+rows, c0:c0+bk] of a [T, Kp] ref; rows >= nv and columns >= n_cols read 0."""
    return ptr.load_block(ref, r0, rows, nv, c0, bk, n_cols)


def _put(ref, r0, nv, c0, n_cols, value):
    ptr.store_block(ref, r0, nv, c0, n_cols, value)


def _row_block(refs, pb, I, first, c0, bk, chunk, diag):
    """One key block's part of score rows I [SUB, BT] fp32; stores qg / kg of sub-chunk I.
    I: Python int or traced; first: I is statically 0 (no earlier sub-chunks).
    chunk = (start, nv, b [BT, bk] Cum, tot [bk] Cum, k [BT, bk]) of the whole chunk."""
    start, nv, b, tot, k = chunk
    K, bt, dt = pb.K, pb.bt, k.dtype
    rs, nvI = start + I * SUB, nv - I * SUB
    loc, _ = gt.cumsum(_tile(refs["g"], rs, SUB, nvI, c0, bk, K).astype(F32))
    R = gt.row(b, I * SUB - 1)                  # b before sub-chunk I (0 for I == 0)
    Rb = gt.bcast(R)
    qI = _tile(refs["q"], rs, SUB, nvI, c0, bk, K)
    kI = _tile(refs["k"], rs, SUB, nvI, c0, bk, K)
    _put(refs["qg"], rs, nvI, c0, K, qI * jnp.exp(gt.add(Rb, loc).value()))
    _put(refs["kg"], rs, nvI, c0, K, kI * jnp.exp(gt.span(tot, R, loc)))
    eloc = jnp.exp(loc.value())
    sub = (jnp.arange(bt) // SUB)[:, None]
    acc = jnp.zeros((SUB, bt), F32)
    if not first:
        kd = (k * gt.masked_exp(gt.gap(Rb, b), sub < I)).astype(dt)
        acc = ptr.matmul((qI * eloc).astype(dt), kd, (1, 1), pb.precision)

    def loop(_):
        return _diag_scores(refs, pb, rs, nvI, qI, kI, (loc, R), K, c0, width=bk,
                            frame=(bt, I * SUB))

    def fast(_):
        # exp(R - b_j) = exp(-loc_j) in [1, e^SPAN) for the rows j of sub-chunk I, 0 elsewhere
        ka = k.astype(F32) * gt.masked_exp(gt.gap(Rb, b), sub == I)
        a = ptr.matmul(qI.astype(F32) * eloc, ka, (1, 1), ptr.accurate_precision())
        causal = jnp.arange(bt)[None, :] <= I * SUB + jnp.arange(SUB)[:, None]
        return jnp.where(causal, a, 0.0)

    if diag == "loop":
        return acc + loop(0)
    return acc + lax.cond(_diag_fits(loc), fast, loop, 0)


def _chunk_block(refs, pb, c0, bk, start, nv, diag):
    """FRAME = "chunk": one key block's part of the chunk's scores [BT, BT] fp32 as Triton's
    kernel forms them (every dot over the whole chunk's rows: row block I's queries masked to
    its rows; the diagonal blocks together, one dot when every sub-chunk of the key block
    stays under SPAN, else per pair in one BT-step column loop); stores qg, kg, el."""
    K, bt = pb.K, pb.bt
    g = _tile(refs["g"], start, bt, nv, c0, bk, K).astype(F32)
    b, tot = gt.cumsum(g)
    q = _tile(refs["q"], start, bt, nv, c0, bk, K)
    k = _tile(refs["k"], start, bt, nv, c0, bk, K)
    dt = q.dtype
    refs["el"][pl.ds(c0, bk)] = jnp.exp(tot.value())
    _put(refs["qg"], start, nv, c0, K, q * jnp.exp(b.value()))
    _put(refs["kg"], start, nv, c0, K, k * jnp.exp(gt.gap(gt.bcast(tot), b)))
    sub = (jnp.arange(bt) // SUB)[:, None]
    Rs, loc = gt.sub_chunk_split(b, SUB)      # b before sub-chunk I; b - b before the row's
    eloc = jnp.exp(loc.value())
    qf = (q * eloc).astype(dt)
    acc = jnp.zeros((bt, bt), F32)
    for I in range(1, bt // SUB):
        kd = (k * gt.masked_exp(gt.gap(gt.bcast(Rs[I]), b), sub < I)).astype(dt)
        acc = acc + ptr.matmul(jnp.where(sub == I, qf, 0.0).astype(dt), kd, (1, 1), pb.precision)
    ii, jj = jnp.arange(bt)[:, None], jnp.arange(bt)[None, :]
    same = (ii >= jj) & (ii // SUB == jj // SUB)
    q32 = q.astype(F32)

    def fast(_):
        # tf32x3 here (H100 GLA bf16 forward, session 11: 0.812 ms; bf16 splits 0.842-0.861)
        a = ptr.accurate_matmul(q32 * eloc, k.astype(F32) * jnp.exp(-loc.value()), (1, 1),
                                sixteen_bit=False)
        return jnp.where(same, a, 0.0)

    def loop(_):
        def body(j, A):
            kj = _row(refs["k"], start + j, j < nv, K, c0, bk)
            d = jnp.where(ii == j, 1.0, gt.masked_exp(gt.gap(loc, gt.bcast(gt.row(loc, j))),
                                                      (ii > j) & (ii // SUB == j // SUB)))
            return jnp.where(jj == j, jnp.sum(q32 * kj[None, :] * d, axis=1)[:, None], A)
        return lax.fori_loop(0, bt, body, jnp.zeros((bt, bt), F32))

    if diag == "loop":
        return acc + loop(0), jnp.asarray(True)
    ok = _diag_fits(loc)
    if diag == "split":         # the dot alone, dropped where it does not fit
        return acc + jnp.where(ok, fast(0), 0.0), ok
    return acc + lax.cond(ok, fast, loop, 0), ok


def _kernel(refs, pb, bk, split, diag, frame):
    bt, K = pb.bt, pb.K
    nb, nk = bt // SUB, pb.Kp // bk
    start, nv = _chunk(refs, pb)
    if frame == "chunk":
        def kchunk(kb, acc):
            a, ok = _chunk_block(refs, pb, kb * bk, bk, start, nv, diag)
            return acc[0] + a, jnp.where(jnp.arange(nk) == kb, ok.astype(jnp.int32), acc[1])
        init = (jnp.zeros((bt, bt), F32), jnp.ones((nk,), jnp.int32))
        acc, fits = blocks(nk, kchunk, init)
        refs["A"][...] = acc.astype(refs["A"].dtype)
        if "fits" in refs:
            refs["fits"][...] = fits
        return
    subs = [pl.program_id(2)] if split else list(range(nb))

    def kblock(kb, accs):
        c0 = kb * bk
        g = _tile(refs["g"], start, bt, nv, c0, bk, K).astype(F32)
        b, tot = gt.cumsum(g)
        k = _tile(refs["k"], start, bt, nv, c0, bk, K)

        def put_el():
            refs["el"][pl.ds(c0, bk)] = jnp.exp(tot.value())

        if split:
            pl.when(subs[0] == 0)(put_el)
        else:
            put_el()
        chunk = (start, nv, b, tot, k)
        return tuple(acc + _row_block(refs, pb, I, not split and I == 0, c0, bk, chunk, diag)
                     for I, acc in zip(subs, accs))

    accs = tuple(jnp.zeros((SUB, bt), F32) for _ in subs)
    accs = blocks(nk, kblock, accs)
    for I, acc in zip(subs, accs):
        refs["A"][pl.ds(I * SUB, SUB), :] = acc.astype(refs["A"].dtype)


def cumsum_scores(pb: Problem, q, k, g, cu, seq, launch: Launch | None = None, split=None,
                  diag=None, frame=None, with_fits=False):
    """q, k [B, T, H, K] (one dtype), g [B, T, H, K] fp32 key gate (pb.gate == GATE_KEY),
    cu / seq (varlen: cu_seqlens int32 [N+1] and varlen.slot_sequences; else None).
    Returns (A [slots, H, BT, BT] in q's dtype, qg = q exp(b), kg = k exp(last - b)
    [B, T, H, K] in q's dtype, el = exp(last) [slots, H, Kp] fp32); see the module docstring.
    launch.bk: key block (None: whole Kp); split / diag / frame: None takes SPLIT / DIAG /
    FRAME (diag "split" needs FRAME "chunk"). with_fits: also return (fits,
    bk): FRAME "chunk"'s flags int32 [slots, H, Kp / bk] (1 where the key block's diagonal
    blocks factor; diag "cond" / "split"), else None (for output_bwd_from_scores)."""
    if pb.gate != gt.GATE_KEY:
        raise ValueError(f"cumsum_scores: key gate only (pb.gate={pb.gate})")
    split = SPLIT if split is None else split
    diag = DIAG if diag is None else diag
    frame = FRAME if frame is None else frame
    if (diag not in DIAGS or frame not in FRAMES or (split and frame != "rows")
            or (diag == "split" and frame != "chunk")):
        raise ValueError(f"cumsum_scores: diag={diag!r}, frame={frame!r}, split={split}; "
                         f"expected diag in {DIAGS}, frame in {FRAMES}, split only with "
                         f"'rows', diag 'split' only with 'chunk'")
    launch = launch or launch_for("cumsum_scores", pb.K, pb.V, q.dtype)
    bk = min(pb.Kp, launch.bk or pb.Kp)
    rows = specs.seq_rows(pb, pb.Kp, specs.zero, parallel=True)
    ins = [("q", q, rows), ("k", k, rows), ("g", g, rows)] + _parallel_inputs(pb, cu, seq)
    outs = [("A", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.bt, pb.bt), q.dtype),
             specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero)),
            ("qg", jax.ShapeDtypeStruct(q.shape, q.dtype), rows),
            ("kg", jax.ShapeDtypeStruct(k.shape, q.dtype), rows),
            ("el", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.Kp), F32), specs.slot_vec(pb.Kp))]
    nk = pb.Kp // bk
    flags = frame == "chunk" and diag != "loop"
    if flags:
        outs.append(("fits", jax.ShapeDtypeStruct((pb.n_slots, pb.H, nk), jnp.int32),
                     specs.slot_vec(nk)))
    grid = (pb.n_slots, pb.H, pb.bt // SUB if split else 1)
    r = call(lambda refs: _kernel(refs, pb, bk, split, diag, frame), grid, ins, outs, launch,
             "engine_cumsum_scores")
    A = r["A"]
    if diag == "split":
        A = diag_fix(pb, ins, {"A": A}, r["fits"], bk, {"A": ("q", False)},
                     "engine_cumsum_scores_fix")["A"]
    out = A, r["qg"], r["kg"], r["el"]
    if with_fits:
        out += ((r["fits"], bk) if flags else None,)
    return out
