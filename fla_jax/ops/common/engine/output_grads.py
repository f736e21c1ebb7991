"""Backward of the engine's output stage from the forward's scores A (Pallas), in three
chunk-parallel kernels, the mirror of the Triton engine's output_bwd (its _bwd_dv_kernel,
_bwd_intra_kernel, _bwd_inter_kernel in fla_torch/ops/common/engine/output_grads.py).

With b the in-chunk inclusive cumsum of the log-decay (split, gates.Cum), `last` its chunk
total, S = h[slot] (state before the chunk), dS = dh[slot] (cotangent of the state after it)
and A the causal scores A_ij = sum_c q_ic k_jc exp(b_ic - b_jc) (j <= i) of the forward:
    dv_j = scale sum_{i >= j} A_ij do_i + (k_j exp(last - b_j)) dS           (kernel dv_dA,
    dA   = scale do v^T (causal, fp32 [slots, H, BT, BT])                     per (slot, head))
    dq_i = scale exp(b_i) do_i S^T + sum_{j <= i} dA_ij exp(b_i - b_j) k_j
    dk_j = exp(last - b_j) v_j dS^T + sum_{i >= j} dA_ij exp(b_i - b_j) q_i
The intra-chunk sums leave out the pair i == j (added as dA_ii k_i / dA_ii q_i): kernel intra
(per (slot, head, K block)) forms them per sub-chunk I of SUB rows: the other sub-chunks in one
16-bit dot each, through the row just before I (dq: k_j exp(b_{i0-1} - b_j), then
exp(b_i - b_{i0-1})) or just after it (dk: q_i exp(b_i - b_{i0+SUB}), then exp(b_{i0+SUB} -
b_j)): every exponent <= 0 and the 16-bit operand keeps its row next to I undecayed (fp16
would flush k exp(-10) to subnormals); the diagonal block as output_stage._diag_grads does
(one fp32-accurate dot through the sub-chunk's start when its decay is under gates.SPAN, else
per pair). INTRA_FRAME "chunk" (shipped) takes every one of those dots over the whole chunk
([BT, BT] x [BT, bk], other sub-chunks masked: Triton's shape), "rows" one [SUB, BT] dot per
sub-chunk. They go through memory (dqi, dki fp32 [slots, H, BT, Kp]) to kernel inter (per
(slot, head, K block)): the state terms, dq, dk and per-chunk dg (nothing carried between
chunks, no O(1) term formed and cancelled):
    dg_s = exp(last) <S, dS>_row + sum_{j < s} r_j + sum_{i >= s} x_i,
    r_j  = k_j . (exp(last - b_j) v_j dS^T)            (0 for the chunk's last valid token),
    x_i  = q_i . (dq_i without the pair i == i) - k_i . (the intra-chunk dk_i without it).
chunk_kda (the per-key-gated delta rule) passes the gradient dAk of its key scores Ak (k . k,
strictly lower) and dkb of kb = k exp(b - b_0) (wy.wy_bwd): the intra kernel runs a second
time on (k, k, dAk) (row sums rk, column sums ck) and the inter kernel adds them and the kb
terms, so its dk, dg come out whole (the role of Triton's delta_bwd).
Shapes: q, k [B, T, H, K]; v, do [B, T, H, V]; g per the gate switch (fp32); h, dh
[slots, H, Kp, Vp]; A [slots, H, BT, BT] (any float dtype; rounded to q's for its dot).
Outputs dq, dk, dv in their inputs' dtypes (dk_dtype may override), dg fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from . import gates as gt
from . import specs
from .launch import SUB, Launch, Problem, call, launch_for, width
from .output_stage import (_chunk, _diag_fits, _diag_grads, _dqk_dg, _dqk_outputs, _gate_input,
                           _gated, _grid, _parallel_inputs, _row)

F32 = jnp.float32
INTRA_FRAMES = ("rows", "chunk")
INTRA_FRAME = "chunk"   # "rows": _intra_kernel (per sub-chunk, [16, BT] dots); "chunk": [BT, BT]
WIDE = 128   # widest column block a kernel holds at once (larger K / V loop over blocks)


def _ld(ref, start, rows, nv, n_cols, c0, w):
    return ptr.load_block(ref, start, rows, nv, c0, w, n_cols)


def _st(ref, start, nv, n_cols, value, c0):
    ptr.store_block(ref, start, nv, c0, n_cols, value)


def _tile(ref, r0, c0, rows, cols):
    """ref[r0:r0+rows, c0:c0+cols] of a padded per-slot tile (no mask needed)."""
    return ref[pl.ds(r0, rows), pl.ds(c0, cols)]


def _graw(refs, pb, start, rows, nv, w, c0, sliced=False):
    """Raw gate tile [rows, w] fp32 of key columns c0.. (a scalar gate broadcast over them).
    sliced: the g block spans every key column (take columns c0..c0+w of it); else the block is
    already the program's key block (c0 only masks)."""
    if pb.gate == gt.GATE_KEY and sliced:
        return _ld(refs["g"], start, rows, nv, pb.K, c0, w).astype(F32)
    return gt.load_gate(refs["g"], pb.gate, start, rows, nv, w, pb.K, c0)


# ----------------------------------------------------------------------------- dv and dA
def _dv_dA_kernel(refs, pb, want_dv):
    start, nv = _chunk(refs, pb)
    bt = pb.bt
    dt = refs["do"].dtype
    bk, bv = min(pb.Kp, WIDE), min(pb.Vp, WIDE)
    kgs = []
    if want_dv:
        At = refs["A"][...].astype(dt)
        for c0 in range(0, pb.Kp, bk):
            if "kg" in refs:          # k exp(last - b) from the forward (cumsum_scores)
                kgs.append(_ld(refs["kg"], start, bt, nv, pb.K, c0, bk).astype(dt))
                continue
            k = _ld(refs["k"], start, bt, nv, pb.K, c0, bk)
            if _gated(pb):
                cum, tot = gt.cumsum(_graw(refs, pb, start, bt, nv, bk, c0, sliced=True))
                k = k * jnp.exp(gt.gap(gt.bcast(tot), cum))
            kgs.append(k.astype(dt))
    dA = jnp.zeros((bt, bt), F32)
    for v0 in range(0, pb.Vp, bv):
        do = _ld(refs["do"], start, bt, nv, pb.V, v0, bv)
        v = _ld(refs["v"], start, bt, nv, pb.V, v0, bv)
        dA = dA + ptr.matmul(do, v, (1, 1), pb.precision)
        if not want_dv:
            continue
        acc = pb.scale * ptr.matmul(At, do, (0, 0), pb.precision)
        for i, c0 in enumerate(range(0, pb.Kp, bk)):
            acc = acc + ptr.matmul(kgs[i], _tile(refs["dh"], c0, v0, bk, bv).astype(dt),
                                   (1, 0), pb.precision)
        _st(refs["dv"], start, nv, pb.V, acc, v0)
    ii = jnp.arange(bt)[:, None]
    jj = jnp.arange(bt)[None, :]
    refs["dA"][...] = jnp.where(ii >= jj, pb.scale * dA, 0.0)


def output_dv_dA(pb: Problem, k, v, g, A, do, dh, cu, seq, launch: Launch | None = None,
                 want_dv=True, kg=None):
    """(dv [B, T, H, V] in v's dtype, dA [slots, H, BT, BT] fp32) from the forward's A.
    want_dv=False: dA alone (dv None; k, g, A and dh are not read). kg: k exp(last - b)
    [B, T, H, K] in k's dtype when the forward kept it (k and g are then not read)."""
    launch = launch or launch_for("output_dv", pb.K, pb.V, k.dtype)
    par = dict(parallel=True)
    ins = [("v", v, specs.seq_rows(pb, pb.Vp, specs.zero, **par)),
           ("do", do, specs.seq_rows(pb, pb.Vp, specs.zero, **par))]
    ins += _parallel_inputs(pb, cu, seq)
    outs = [("dA", jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.bt, pb.bt), F32),
             specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero))]
    if want_dv:
        ins += [("A", A, specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero)),
                ("dh", dh, specs.slot_state(pb.Kp, pb.Vp, specs.zero, specs.zero))]
        if kg is not None:
            ins.append(("kg", kg, specs.seq_rows(pb, pb.Kp, specs.zero, **par)))
        else:
            ins.append(("k", k, specs.seq_rows(pb, pb.Kp, specs.zero, **par)))
            ins += _gate_input(pb, g, pb.Kp, specs.zero)
        outs.append(("dv", jax.ShapeDtypeStruct(v.shape, v.dtype),
                     specs.seq_rows(pb, pb.Vp, specs.zero, **par)))
    r = call(lambda refs: _dv_dA_kernel(refs, pb, want_dv), _grid(pb, 1), ins, outs, launch,
             "engine_output_dv_dA")
    return r.get("dv"), r["dA"]


# ----------------------------------------------------------------------------- intra
def _intra_kernel(refs, pb, bk):
    r0 = pl.program_id(2) * bk
    start, nv = _chunk(refs, pb)
    bt = pb.bt
    dt = refs["q"].dtype
    row = jnp.arange(bt)[:, None]
    q = ptr.load_rows(refs["q"], start, bt, nv, pb.K, r0)
    k = ptr.load_rows(refs["k"], start, bt, nv, pb.K, r0)
    gated = _gated(pb)
    if gated:
        b, _ = gt.cumsum(_graw(refs, pb, start, bt, nv, bk, r0))
    for I in range(bt // SUB):
        i0 = I * SUB
        rs, nvI = start + i0, nv - i0
        qI = ptr.load_rows(refs["q"], rs, SUB, nvI, pb.K, r0)
        kI = ptr.load_rows(refs["k"], rs, SUB, nvI, pb.K, r0)
        locI = None
        if gated:
            locI, _ = gt.cumsum(_graw(refs, pb, rs, SUB, nvI, bk, r0))
        dq = jnp.zeros((SUB, bk), F32)
        dk = jnp.zeros((SUB, bk), F32)
        if I > 0:
            # earlier sub-chunks, through the row before I (b_before = b_{i0-1})
            dA_I = jnp.where(jnp.arange(bt)[None, :] < i0, _tile(refs["dA"], i0, 0, SUB, bt), 0.0)
            if gated:
                before = gt.row(b, i0 - 1)
                kd = k * gt.masked_exp(gt.gap(gt.bcast(before), b), row < i0)
            else:
                kd = k.astype(F32)
            x = ptr.matmul(dA_I.astype(dt), kd.astype(dt), (1, 0), pb.precision)
            if gated:
                x = x * jnp.exp(locI.value())    # b_i - b_{i0-1} = loc_i (inclusive from i0)
            dq = dq + x
        if I < bt // SUB - 1:
            # later sub-chunks, through the row after I (b_after = b_{i0+SUB})
            n0 = i0 + SUB
            dAt = jnp.where(row >= n0, _tile(refs["dA"], 0, i0, bt, SUB), 0.0)
            if gated:
                after = gt.row(b, n0)
                qd = q * gt.masked_exp(gt.gap(b, gt.bcast(after)), row >= n0)
            else:
                qd = q.astype(F32)
            y = ptr.matmul(dAt.astype(dt), qd.astype(dt), (0, 0), pb.precision)
            if gated:
                # b_after - b_j for j in I: (after - start_I) - loc_j, start_I = b_{i0-1}
                startI = gt.row(b, i0 - 1) if I > 0 else gt.zero_cum(bk)
                y = y * jnp.exp(gt.span(after, startI, locI))
            dk = dk + y
        dA_II = _tile(refs["dA"], i0, i0, SUB, SUB)
        dqd, dkd = _diag_grads(refs, pb, rs, nvI, qI, kI, (locI, None), dA_II, pb.K, r0)
        ptr.store_rows(refs["dqi"], i0, None, None, dq + dqd)
        ptr.store_rows(refs["dki"], i0, None, None, dk + dkd)


def _intra_chunk_kernel(refs, pb, bk):
    """INTRA_FRAME = "chunk": the same sums as _intra_kernel with every dot over the whole
    chunk ([BT, BT] x [BT, bk], Triton's shape; rows / columns of other sub-chunks masked to
    zero): one dot per sub-chunk for each cross term, the diagonal blocks of all sub-chunks in
    one fp32-accurate dot when every sub-chunk's decay stays under SPAN, else a BT-step per-pair
    column loop."""
    r0 = pl.program_id(2) * bk
    start, nv = _chunk(refs, pb)
    bt, nb = pb.bt, pb.bt // SUB
    dt = refs["q"].dtype
    row = jnp.arange(bt)[:, None]
    col = jnp.arange(bt)[None, :]
    sub, csub = row // SUB, col // SUB
    q = ptr.load_rows(refs["q"], start, bt, nv, pb.K, r0)
    k = ptr.load_rows(refs["k"], start, bt, nv, pb.K, r0)
    q32, k32 = q.astype(F32), k.astype(F32)
    dA = refs["dA"][...]
    gated = _gated(pb)
    dq = jnp.zeros((bt, bk), F32)
    dk = jnp.zeros((bt, bk), F32)
    if gated:
        b, _ = gt.cumsum(_graw(refs, pb, start, bt, nv, bk, r0))
        Rs, loc = gt.sub_chunk_split(b, SUB)
    for I in range(1, nb):
        # rows of sub-chunk I against earlier columns, through b_{i0-1} = Rs[I]
        i0 = I * SUB
        kd = k32 * gt.masked_exp(gt.gap(gt.bcast(Rs[I]), b), row < i0) if gated else k32
        dq = dq + ptr.matmul(jnp.where((sub == I) & (col < i0), dA, 0.0).astype(dt),
                             kd.astype(dt), (1, 0), pb.precision)
    if gated:
        dq = dq * jnp.exp(loc.value())
    for J in range(nb - 1):
        # columns of sub-chunk J against later rows, through b_n (n = the row after J)
        n0 = (J + 1) * SUB
        if gated:
            N = gt.bcast(gt.row(b, n0))
            qd = q32 * gt.masked_exp(gt.gap(b, N), row >= n0)
        else:
            qd = q32
        y = ptr.matmul(jnp.where((row >= n0) & (csub == J), dA, 0.0).astype(dt),
                       qd.astype(dt), (0, 0), pb.precision)
        dk = dk + (y * gt.masked_exp(gt.gap(N, b), sub == J) if gated else y)
    D = jnp.where((row > col) & (sub == csub), dA, 0.0)
    half = dt != F32

    def amm(a, b, contract):
        return ptr.accurate_matmul(a, b, contract, half)
    if not gated:
        refs["dqi"][...] = dq + amm(D, k32, (1, 0))
        refs["dki"][...] = dk + amm(D, q32, (0, 0))
        return

    def fast(_):
        e = jnp.exp(loc.value())
        return (e * amm(D, k32 / e, (1, 0)), amm(D, q32 * e, (0, 0)) / e)

    def loop(_):
        return _diag_loop(refs, pb, r0, start, nv, D, loc, q32)

    if "fits" in refs:      # the dot alone; where it does not fit, _intra_fix_kernel's loop
        dqd, dkd = fast(0)
        ok = refs["fits"][pl.program_id(2)] != 0
        dqd, dkd = jnp.where(ok, dqd, 0.0), jnp.where(ok, dkd, 0.0)
    else:
        dqd, dkd = lax.cond(_diag_fits(loc), fast, loop, 0)
    refs["dqi"][...] = dq + dqd
    refs["dki"][...] = dk + dkd


def _diag_loop(refs, pb, r0, start, nv, D, loc, q32):
    """The in-sub-chunk pairs (D = dA's strictly lower diagonal blocks [BT, BT]) exactly per
    pair: (xq, xk) [BT, bk] fp32, one column j per step (BT steps; key row j read from
    refs['k'] at column r0)."""
    bt, bk = D.shape[0], q32.shape[1]
    row, col = jnp.arange(bt)[:, None], jnp.arange(bt)[None, :]
    sub = row // SUB

    def body(j, carry):
        xq, xk = carry
        kj = _row(refs["k"], start + j, j < nv, pb.K, r0)
        a = jnp.sum(jnp.where(col == j, D, 0.0), axis=1)[:, None]
        d = gt.masked_exp(gt.gap(loc, gt.bcast(gt.row(loc, j))), (row > j) & (sub == j // SUB))
        w = a * d
        xq = xq + w * kj[None, :]
        xk = xk + jnp.where(row == j, jnp.sum(w * q32, axis=0)[None, :], 0.0)
        return xq, xk
    z = jnp.zeros((bt, bk), F32)
    return lax.fori_loop(0, bt, body, (z, z))


def _intra_fix_kernel(refs, pb, bk):
    """Flags given (chunk_kda, chunk_gla): per (slot, head, key block) whose flag
    (refs['fits']) is 0, adds the exact in-sub-chunk pairs to dqi / dki in place (the intra
    kernel dropped its factored dot there); nothing runs where the flag is 1. Per sub-chunk
    [SUB, bk] tiles and SUB column steps, step j reading key row j, its raw gate (their running
    split sum gives loc_j) and column j of dA's diagonal block, as output_stage.diag_fix_kernel
    (H100 KDA bf16, every block exact: 2.30 ms per intra launch; 6.6 ms with _diag_loop's
    BT-step loop on [BT, bk] tiles)."""
    c = pl.program_id(2)
    r0 = c * bk
    start, nv = _chunk(refs, pb)          # (program ids outside pl.when: interpret mode)
    ii, jj = jnp.arange(SUB)[:, None], jnp.arange(SUB)[None, :]

    @pl.when(refs["fits"][c] == 0)
    def _():
        def sub_chunk(I, carry):
            i0 = I * SUB
            rs, nvI = start + i0, nv - i0
            q32 = ptr.load_rows(refs["q"], rs, SUB, nvI, pb.K, r0).astype(F32)
            loc, _ = gt.cumsum(_graw(refs, pb, rs, SUB, nvI, bk, r0))
            D = jnp.where(ii > jj, refs["dA"][pl.ds(i0, SUB), pl.ds(i0, SUB)], 0.0)

            def body(j, acc):
                xq, xk, r = acc
                ok = j < nvI
                r = gt.add(r, gt.split(_row(refs["g"], rs + j, ok, pb.K, r0)))   # loc_j
                kj = _row(refs["k"], rs + j, ok, pb.K, r0)
                a = jnp.sum(jnp.where(jj == j, D, 0.0), axis=1)[:, None]
                w = a * gt.masked_exp(gt.gap(loc, gt.bcast(r)), ii > j)
                xq = xq + w * kj[None, :]
                xk = xk + jnp.where(ii == j, jnp.sum(w * q32, axis=0)[None, :], 0.0)
                return xq, xk, r

            z = jnp.zeros((SUB, bk), F32)
            xq, xk, _ = lax.fori_loop(0, SUB, body, (z, z, gt.zero_cum(bk)))
            rows = (pl.ds(i0, SUB), slice(None))
            refs["dqi"][rows] = refs["dqi"][rows] + xq
            refs["dki"][rows] = refs["dki"][rows] + xk
            return carry

        lax.fori_loop(0, pb.bt // SUB, sub_chunk, 0)


def flags_for(fits, bk):
    """(flags int32 [slots, H, Kp / bkf], bkf) -> the flags of key blocks of `bk` columns: a
    block fits where every block of bkf it overlaps fits."""
    fl, bkf = fits
    if bk <= bkf:
        return jnp.repeat(fl, bkf // bk, axis=-1)
    n, H, m = fl.shape
    return jnp.min(fl.reshape(n, H, m * bkf // bk, bk // bkf), axis=-1)


def _intra(pb, q, k, g, dA, cu, seq, bk, launch, frame=None, fits=None):
    par = dict(parallel=True)
    ins = [("q", q, specs.seq_rows(pb, bk, specs.same, **par)),
           ("k", k, specs.seq_rows(pb, bk, specs.same, **par)),
           ("dA", dA, specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero))]
    ins += _gate_input(pb, g, bk, specs.same) + _parallel_inputs(pb, cu, seq)
    shp = jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.bt, pb.Kp), F32)
    blk = specs.slot_state(pb.bt, bk, specs.zero, specs.same)
    outs = [("dqi", shp, blk), ("dki", shp, blk)]
    frame = frame or INTRA_FRAME
    if frame not in INTRA_FRAMES:
        raise ValueError(f"output_grads: frame={frame!r}; expected one of {INTRA_FRAMES}")
    split = fits is not None and frame == "chunk" and _gated(pb)
    if split:
        fl = flags_for(fits, bk)
        ins.append(("fits", fl, specs.slot_vec(fl.shape[-1])))
    kern = _intra_chunk_kernel if frame == "chunk" else _intra_kernel
    grid = _grid(pb, pl.cdiv(pb.K, bk))
    r = call(lambda refs: kern(refs, pb, bk), grid, ins, outs, launch, "engine_output_intra")
    if split:
        io = [("dqi_in", r["dqi"], blk), ("dki_in", r["dki"], blk)]
        r = call(lambda refs: _intra_fix_kernel(refs, pb, bk), grid, ins + io, outs, launch,
                 "engine_output_intra_fix", aliases={"dqi_in": "dqi", "dki_in": "dki"})
    return r["dqi"], r["dki"]


# ----------------------------------------------------------------------------- inter
def _inter_kernel(refs, pb, bk):
    r0 = pl.program_id(2) * bk
    start, nv = _chunk(refs, pb)
    bt = pb.bt
    dt = refs["q"].dtype
    bv = min(pb.Vp, WIDE)
    row = jnp.arange(bt)[:, None]
    q = ptr.load_rows(refs["q"], start, bt, nv, pb.K, r0).astype(F32)
    k = ptr.load_rows(refs["k"], start, bt, nv, pb.K, r0).astype(F32)
    dq_s = jnp.zeros((bt, bk), F32)
    dk_s = jnp.zeros((bt, bk), F32)
    ct = jnp.zeros((bk,), F32)
    for v0 in range(0, pb.Vp, bv):
        do = _ld(refs["do"], start, bt, nv, pb.V, v0, bv)
        v = _ld(refs["v"], start, bt, nv, pb.V, v0, bv)
        S = _tile(refs["h"], 0, v0, bk, bv)
        dS = _tile(refs["dh"], 0, v0, bk, bv)
        dq_s = dq_s + ptr.matmul(do, S.astype(dt), (1, 1), pb.precision)
        dk_s = dk_s + ptr.matmul(v, dS.astype(dt), (1, 1), pb.precision)
        if _gated(pb):
            ct = ct + jnp.sum(S.astype(F32) * dS.astype(F32), axis=1)
    dq_s = pb.scale * dq_s
    if _gated(pb):
        b, tot = gt.cumsum(_graw(refs, pb, start, bt, nv, bk, r0))
        dq_s = dq_s * jnp.exp(b.value())
        dk_s = dk_s * jnp.exp(gt.gap(gt.bcast(tot), b))
    dqi = refs["dqi"][...]
    dki = refs["dki"][...]
    dA = refs["dA"][...]
    d_ii = jnp.sum(jnp.where(row == jnp.arange(bt)[None, :], dA, 0.0), axis=1)[:, None]
    dk = dk_s + dki + d_ii * q
    if "dkb" in refs:
        # the delta rule's key scores (rk, ck: their row / column sums) and relative keys
        # kb = k exp(b - b_0): dk += r + c + dkb exp(b - b_0); db = k (r - c) + k dkb exp(b - b_0)
        dkb = ptr.load_rows(refs["dkb"], start, bt, nv, pb.K, r0).astype(F32)
        dkb = dkb * jnp.exp(gt.gap(b, gt.bcast(gt.row(b, 0))))
        rk, ck = refs["rk"][...], refs["ck"][...]
        dk = dk + rk + ck + dkb
    ptr.store_rows(refs["dq"], start, nv, pb.K, dq_s + dqi + d_ii * k, r0)
    ptr.store_rows(refs["dk"], start, nv, pb.K, dk, r0)
    if not _gated(pb):
        return
    ct = ct * jnp.exp(tot.value())
    x = q * (dq_s + dqi) - k * dki
    if "dkb" in refs:
        x = x + k * (rk - ck + dkb)
    r = jnp.where(row == jnp.minimum(nv, bt) - 1, 0.0, k * dk_s)
    w = (ct[None, :] + (jnp.cumsum(r, axis=0) - r) - (jnp.cumsum(x, axis=0) - x)
         + jnp.sum(x, axis=0)[None, :])
    if pb.gate == gt.GATE_KEY:
        ptr.store_rows(refs["dg"], start, nv, pb.K, w, r0)
    else:
        ptr.store_rows(refs["dg"], start, nv, None, jnp.sum(w, axis=1))


def output_bwd_from_scores(pb: Problem, q, k, v, g, A, h, do, dh, cu, seq,
                           launch_dv: Launch | None = None, launch_intra: Launch | None = None,
                           launch_inter: Launch | None = None, dk_dtype=None, want_dv=True,
                           kg=None, dAk=None, dkb=None, dA=None, fits=None):
    """output_stage.output_bwd's cotangents (dq, dk, dv, dg; same shapes, dtypes and options)
    from the forward's scores A [slots, H, BT, BT] (zero above the diagonal) instead of
    re-forming them. want_dv=False: dv None (its kernel forms dA alone). kg: the forward's
    k exp(last - b) (cumsum_scores), read by the dv kernel instead of k and g.
    The per-key-gated delta rule (chunk_kda) passes dAk [slots, H, BT, BT] fp32 (the gradient
    of its key scores Ak, strictly lower) and dkb [B, T, H, K] fp32 (the gradient of
    kb = k exp(b - b_0)), both from wy.wy_bwd: dk and dg then include their terms (GATE_KEY
    only). dA: the score gradient scale do v^T (causal, fp32) when the caller formed it
    (KDA's delta_prep_bwd; only with want_dv=False): no dv / dA kernel runs then. fits:
    (flags, bk) from delta_scores / cumsum_scores(with_fits=True) (GATE_KEY): the intra kernels
    then keep their factored diagonal dot by the flag (no lax.cond) and a second kernel adds
    the exact pairs of the key blocks that do not fit."""
    if dA is not None and want_dv:
        raise ValueError("output_bwd_from_scores: dA given with want_dv=True; expected "
                         "want_dv=False (the dv kernel forms dA itself)")
    if (dAk is None) != (dkb is None) or (dAk is not None and pb.gate != gt.GATE_KEY):
        raise ValueError(f"output_bwd_from_scores: dAk and dkb go together and with the key "
                         f"gate; got dAk={dAk is not None}, dkb={dkb is not None}, "
                         f"gate={pb.gate}")
    li = launch_intra or launch_for("output_intra", pb.K, pb.V, q.dtype)
    lo = launch_inter or launch_for("output_inter", pb.K, pb.V, q.dtype)
    dv = None
    if dA is None:
        dv, dA = output_dv_dA(pb, k, v, g, A, do, dh, cu, seq, launch_dv, want_dv, kg)
    bk = width(pb.Kp, li.bk)
    dqi, dki = _intra(pb, q, k, g, dA, cu, seq, bk, li, fits=fits)
    # the key scores' sums on (k, k) in a second launch of the same kernel (one kernel holding
    # both dA tiles spilled: 5.45 ms against 2.17 + 1.06 on the H100, session 11):
    # rk_i = sum_{j<i} dAk_ij exp(b_i - b_j) k_j (its "dqi"), ck_j = sum_{i>j} ... k_i ("dki")
    rc = (_intra(pb, k, k, g, dAk, cu, seq, bk, li, fits=fits) if dAk is not None
          else (None, None))
    dq, dk, dg = _inter(pb, q, k, v, g, h, do, dh, dA, dqi, dki, cu, seq, width(pb.Kp, lo.bk),
                        lo, dk_dtype, rc, dkb)
    return dq, dk, dv, dg


def _inter(pb, q, k, v, g, h, do, dh, dA, dqi, dki, cu, seq, bk, launch, dk_dtype=None,
           rc=(None, None), dkb=None):
    rk, ck = rc
    nkb = pl.cdiv(pb.K, bk)
    par = dict(parallel=True)
    ins = [("q", q, specs.seq_rows(pb, bk, specs.same, **par)),
           ("k", k, specs.seq_rows(pb, bk, specs.same, **par)),
           ("v", v, specs.seq_rows(pb, pb.Vp, specs.zero, **par)),
           ("do", do, specs.seq_rows(pb, pb.Vp, specs.zero, **par)),
           ("dA", dA, specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero)),
           ("dqi", dqi, specs.slot_state(pb.bt, bk, specs.zero, specs.same)),
           ("dki", dki, specs.slot_state(pb.bt, bk, specs.zero, specs.same))]
    if dkb is not None:
        ins += [("rk", rk, specs.slot_state(pb.bt, bk, specs.zero, specs.same)),
                ("ck", ck, specs.slot_state(pb.bt, bk, specs.zero, specs.same)),
                ("dkb", dkb, specs.seq_rows(pb, bk, specs.same, **par))]
    ins += _gate_input(pb, g, bk, specs.same) + _parallel_inputs(pb, cu, seq)
    ins += [("h", h, specs.slot_state(bk, pb.Vp, specs.same, specs.zero)),
            ("dh", dh, specs.slot_state(bk, pb.Vp, specs.same, specs.zero))]
    outs = _dqk_outputs(pb, q, k, g, bk, nkb, dk_dtype)
    r = call(lambda refs: _inter_kernel(refs, pb, bk), _grid(pb, nkb), ins, outs, launch,
             "engine_output_inter")
    return r["dq"], r["dk"], _dqk_dg(pb, r)
