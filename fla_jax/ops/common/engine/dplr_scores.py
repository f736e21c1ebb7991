"""Per-key-decay scores of a DPLR chunk (Pallas, Triton lowering), forward and backward
(jax.custom_vjp): the mirror of fla_torch/ops/common/engine/dplr_scores.py.

Inputs in the token-major slot layout [S, BT, H, K] fp32 (dplr.py: a reshape of the token
layout for fixed length): row vectors x in {r, a_s} and column vectors y in {b, k}, the
log-decay w (pad rows zero); outputs in the head-major [S, H, BT, *], except the gradients of
the inputs (token-major, as the inputs); a_s is a shifted up by one row
(a_s[m] = a[m + 1]), so that every matrix pairs x_i and y_j through exp(G_i - G_j), j <= i,
with G_i = w_1 + ... + w_i the in-chunk cumsum per key:
    M_xy[i, j] = sum_c x_ic y_jc exp(G_ic - G_jc)   (j <= i; the pair i == j is gate-free)
    x_in = x exp(G),  y_out = y exp(L - G),  tot = exp(L)        (L: G at the chunk's end)
(dplr.py turns M_ab, M_ak of a_s into the strictly lower A_ab, A_ak of a.)

Gates: split cumsums (engine/gates.py: hi on a 2^-8 grid, exact, + a small lo), so every gap
keeps fp32 accuracy when the cumsum reaches -1000s. Sub-chunks of SUB = 16 rows: pairs with
earlier rows factor through R_I (G before sub-chunk I) as (x_i exp(G_i - R_I))
(y_j exp(R_I - G_j)), both exponents <= 0, into fp32-accurate dots; pairs inside a sub-chunk
are exact per pair (one column per loop step). Masked before exp: no overflow at -20 per token.

Backward: dx, dy by the same pairs, and dw without carrying anything across chunks: a pair
(i, j), i > j, gives c = dM_ij x_i y_j exp(G_i - G_j) to every w_s with j < s <= i, gathered as
P_i (row side) and Q_j (column side): dw_s = sum_{t >= s} (P_t - Q_t); the pairs i == j
depend on no gate and are left out (no O(1) term formed and cancelled under strong gates);
the chunk-end terms y_out reach w_s for s > j only (a strict prefix sum), tot every w_s.

Compile size: the loops over sub-chunks, K blocks and the in-sub-chunk columns are
lax.fori_loop (scf.for in the Triton IR), so each kernel holds one copy of its loop bodies
whatever K is, and no [SUB, SUB, BK] tensor is formed (K = 64: 1.5k / 2.2k TTIR lines; for
sm_90, 242 registers and no spills forward). Unrolled in Python the same kernels were 6k / 12k
lines at K = 64, twice that at K = 128, and took minutes each to compile.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .. import pallas_triton as ptr
from . import gates as gt
from .launch import SUB, Launch, blocks, call
from .output_stage import _diag_fits

F32 = jnp.float32
XS = ("r", "a")           # row vectors (a: shifted up by one row)
YS = ("b", "k")           # column vectors
PAIRS = tuple((x, y) for x in XS for y in YS)      # rb, rk, ab, ak

# How the pairs inside a 16-row sub-chunk (the diagonal blocks) are formed, forward and
# backward:
#   "split": one fp32-accurate dot per pair through exp(+-loc) (from the sub-chunk's start)
#     wherever the key block's decay across the sub-chunk stays under gates.SPAN, with no
#     branch; the forward scores kernel writes that decision per (sub-chunk, key block) as
#     int32 flags, which the backward and both fix kernels read (one decision for all four);
#     a second kernel (_fix_fwd_kernel / _fix_bwd_kernel) adds, in place, the exact per-pair
#     terms of the blocks past it, its programs doing nothing where every block fits
#     (RWKV-7's decays, w > -0.61 per token, always do: 16 * 0.61 < 20). The KDA scores'
#     split (delta_scores.py, output_stage.diag_fix) measured 0.98 -> 0.75 ms on the H100.
#   "loop": every diagonal block exact per pair (SUB column steps per key block).
DIAGS = ("split", "loop")
DIAG = "split"
FIX_LAUNCH = Launch(None, None, 4, 1)
WARPS = {"fwd": 4, "bwd": 4}      # the scores kernels' warps (one program per slot and head)
# and their Triton num_stages (software pipelining of the sub-chunk / key-block loops' loads).
# H100 bf16 RWKV-7 B4 T4096 H16 K64, whole op fwd+bwd (session 14 call 5): 1 / 1 4.557 ms,
# 2 / 2 4.436, 3 / 3 4.307, 1 / 2 4.344, 2 / 1 4.648
STAGES = {"fwd": 3, "bwd": 3}
BK = [32]                         # their key block (the last entry; benchmarks may push one)


def _bk(Kp):
    return min(Kp, BK[-1])


def _chunk_gates(refs, cols, BT, BK):
    """Full-chunk Cum of G [BT, BK] and the chunk total L [BK] (Cum)."""
    w = refs["w"][:, cols]
    return gt.cumsum(w)


def _sub_gates(refs, i0, cols):
    """loc (Cum [SUB, BK]: cumsum from the sub-chunk's start) and its total (Cum [BK])."""
    return gt.cumsum(refs["w"][pl.ds(i0, SUB), cols])


def _before(G: gt.Cum, i0):
    """R_I = G at row i0 - 1 (zero for i0 = 0; i0 may be traced) as a [BK] Cum."""
    return gt.row(G, i0 - 1)


def _pair_col(loc: gt.Cum, j):
    """[SUB, BK]: exp(loc_i - loc_j) for rows i > j (j may be traced), else 0: column j of
    the sub-chunk's pair decays, masked before exp."""
    ii = lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    return gt.masked_exp(gt.gap(loc, gt.bcast(gt.row(loc, j))), ii > j)


def _diag_scores(refs, xs, loc, i0, cols):
    """(M_xy inside the sub-chunk [SUB, SUB] per pair, j <= i), exact per pair: one column j
    per loop step, its rows y_j read from the refs."""
    ii = lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    jj = lax.broadcasted_iota(jnp.int32, (1, SUB), 1)

    def column(j, dia):
        d = jnp.where(ii == j, 1.0, _pair_col(loc, j))
        xd = {x: xs[x] * d for x in XS}
        yj = {y: refs[y][i0 + j, cols].astype(F32) for y in YS}
        return tuple(jnp.where(jj == j, jnp.sum(xd[x] * yj[y][None, :], axis=1)[:, None],
                               dia[n]) for n, (x, y) in enumerate(PAIRS))

    return lax.fori_loop(0, SUB, column, tuple(jnp.zeros((SUB, SUB), F32) for _ in PAIRS))


def _diag_grads(refs, xs, q, loc, i0, cols):
    """In-sub-chunk strict pairs (i > j) of dx [SUB, BK] per x and dy per y from the score
    cotangents q[x, y] [SUB, SUB]: dx_i += q_ij e_ij y_j, dy_j += sum_i q_ij e_ij x_i, one
    column j per loop step."""
    ii = lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    jj = lax.broadcasted_iota(jnp.int32, (1, SUB), 1)

    def column(j, carry):
        gx, gy = dict(zip(XS, carry[0])), dict(zip(YS, carry[1]))
        d = _pair_col(loc, j)
        yj = {y: refs[y][i0 + j, cols].astype(F32) for y in YS}
        for x, y in PAIRS:
            wgt = jnp.sum(jnp.where(jj == j, q[x, y], 0.0), axis=1)[:, None] * d
            gx[x] = gx[x] + wgt * yj[y][None, :]
            gy[y] = gy[y] + jnp.where(ii == j, jnp.sum(wgt * xs[x], axis=0)[None, :], 0.0)
        return tuple(gx[x] for x in XS), tuple(gy[y] for y in YS)

    z = jnp.zeros(xs[XS[0]].shape, F32)
    return lax.fori_loop(0, SUB, column, ((z,) * len(XS), (z,) * len(YS)))


def _flag(flags, idx):
    """Element idx (traced) of an int32 flag vector, as a bool (a masked sum: tiles cannot be
    indexed in the Triton lowering). Flags: 1 where block (sub-chunk I, key block kb), at
    I * nk + kb, fits (output_stage._diag_fits), written by the forward scores kernel and
    read by every later kernel, so that all of them take the same decision."""
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, flags.shape, 0) == idx, flags,
                             0)) > 0


def _factors(loc: gt.Cum, fit):
    """(exp(loc), exp(-loc)) [SUB, BK], both 0 where the block does not fit (no overflow)."""
    lv = jnp.where(fit, loc.value(), 0.0)
    return jnp.where(fit, jnp.exp(lv), 0.0), jnp.where(fit, jnp.exp(-lv), 0.0)


# ptr.BF16 problems: the factored diagonal blocks of the forward / backward as one bf16
# product (True) or fp32-accurate (False: three bf16 products, as the Triton stages')
DIAG_BF16 = {"fwd": False, "bwd": False}


def _diag_dot(a, b, contract, prec, kind):
    """A factored diagonal block's product: fp32-accurate (ptr.accurate_matmul: bf16 splits
    for 16-bit problems, else tf32x3), or one bf16 product for ptr.BF16 where
    DIAG_BF16[kind]."""
    bf16 = isinstance(prec, str) and prec == ptr.BF16
    if bf16 and DIAG_BF16[kind]:
        return ptr.dot(a, b, contract, prec)
    return ptr.accurate_matmul(a, b, contract, prec == ptr.SPLIT3 or bf16)


def _diag_scores_dot(refs, xs, loc, fit, i0, cols, prec):
    """_diag_scores by one fp32-accurate dot per pair through the factors (j <= i; 0 where
    the block does not fit, fit False: _fix_fwd_kernel adds those exactly)."""
    ii = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    jj = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    e_p, e_m = _factors(loc, fit)
    ym = {y: refs[y][pl.ds(i0, SUB), cols].astype(F32) * e_m for y in YS}
    return tuple(jnp.where(ii >= jj, _diag_dot(xs[x] * e_p, ym[y], (1, 1), prec, "fwd"), 0.0)
                 for x, y in PAIRS)


def _diag_grads_dot(xs, ys, q, loc, fit, prec, q_dtypes):
    """_diag_grads by dots through the factors (strict pairs; 0 where the block does not fit,
    fit False: _fix_bwd_kernel adds those exactly): dx_i = e^{loc_i} sum_j q_ij y_j e^{-loc_j},
    dy_j = e^{-loc_j} sum_i q_ij x_i e^{loc_i}. q_dtypes {pair: dtype} of the cotangents as
    stored: a bf16 one enters the products as bf16 (exact; one split operand fewer)."""
    ii = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    jj = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    e_p, e_m = _factors(loc, fit)
    qs = {p: jnp.where(ii > jj, q[p], 0.0).astype(q_dtypes[p]) for p in PAIRS}
    dx = tuple(e_p * sum(_diag_dot(qs[x, y], ys[y] * e_m, (1, 0), prec, "bwd") for y in YS)
               for x in XS)
    dy = tuple(e_m * sum(_diag_dot(qs[x, y], xs[x] * e_p, (0, 0), prec, "bwd") for x in XS)
               for y in YS)
    return dx, dy


# ------------------------------------------------------------------------------ forward
def _fwd_kernel(refs, BT, Kp, prec):
    BK = _bk(Kp)
    nk, nb = Kp // BK, BT // SUB
    rows = lax.broadcasted_iota(jnp.int32, (BT, 1), 0)

    def vectors(kb, carry):
        cols = pl.ds(kb * BK, BK)
        G, L = _chunk_gates(refs, cols, BT, BK)
        eG = jnp.exp(G.value())
        for x in XS:
            ref = refs[f"{x}_in"]
            ref[:, cols] = (refs[x][:, cols].astype(F32) * eG).astype(ref.dtype)
        e_end = jnp.exp(gt.gap(gt.bcast(L), G))
        for y in YS:
            ref = refs[f"{y}_out"]
            ref[:, cols] = (refs[y][:, cols].astype(F32) * e_end).astype(ref.dtype)
        refs["tot"][cols] = jnp.exp(L.value())
        return carry

    lax.fori_loop(0, nk, vectors, 0)

    split = "fits" in refs
    fidx = lax.broadcasted_iota(jnp.int32, (nb * nk,), 0)

    def sub_chunk(I, flags):
        i0 = I * SUB

        def block(kb, acc_dia):
            acc, dia, flags = acc_dia
            cols = pl.ds(kb * BK, BK)
            xs = {x: refs[x][pl.ds(i0, SUB), cols].astype(F32) for x in XS}
            loc, _ = _sub_gates(refs, i0, cols)
            G, _ = _chunk_gates(refs, cols, BT, BK)
            R = _before(G, i0)
            e_c = gt.masked_exp(gt.gap(gt.bcast(R), G), rows < i0)           # [BT, BK]
            e_r = jnp.exp(loc.value())                                        # [SUB, BK]
            cy = {y: refs[y][:, cols].astype(F32) * e_c for y in YS}
            acc = tuple(acc[n] + ptr.dot(xs[x] * e_r, cy[y], (1, 1), prec)
                        for n, (x, y) in enumerate(PAIRS))
            if split:
                fit = _diag_fits(loc)
                flags = jnp.where(fidx == I * nk + kb, fit.astype(jnp.int32), flags)
                dd = _diag_scores_dot(refs, xs, loc, fit, i0, cols, prec)
            else:
                dd = _diag_scores(refs, xs, loc, i0, cols)
            return acc, tuple(dia[n] + dd[n] for n in range(len(PAIRS))), flags

        init = (tuple(jnp.zeros((SUB, BT), F32) for _ in PAIRS),
                tuple(jnp.zeros((SUB, SUB), F32) for _ in PAIRS), flags)
        acc, dia, flags = lax.fori_loop(0, nk, block, init)
        cidx = lax.broadcasted_iota(jnp.int32, (SUB, BT), 1)
        for n, (x, y) in enumerate(PAIRS):
            ref = refs[f"M_{x}{y}"]
            plt.store(ref.at[pl.ds(i0, SUB), :],
                      jnp.where(cidx < i0, acc[n], 0.0).astype(ref.dtype),
                      mask=(cidx < i0) | (cidx >= i0 + SUB))
            ref[pl.ds(i0, SUB), pl.ds(i0, SUB)] = dia[n].astype(ref.dtype)
        return flags

    flags = lax.fori_loop(0, nb, sub_chunk, jnp.zeros((nb * nk,), jnp.int32))
    if split:
        refs["fits"][...] = flags


def _count_unfit(flags, I, nk):
    """Number of key blocks of sub-chunk I whose flag is 0 (int32)."""
    idx = lax.broadcasted_iota(jnp.int32, flags.shape, 0)
    return jnp.sum(jnp.where((idx >= I * nk) & (idx < I * nk + nk), 1 - flags, 0))


def _fix_frame(refs, Kp):
    """(I, i0, BK, nk, flags) of a fix kernel's program: its sub-chunk I (first row i0), the
    key block width and count, the forward's flags (program ids read outside pl.when bodies:
    interpret mode)."""
    I = pl.program_id(2)
    BK = _bk(Kp)
    return I, I * SUB, BK, Kp // BK, refs["fits"][...]


def _fix_fwd_kernel(refs, Kp):
    """DIAG "split", forward: one program per (slot, head, sub-chunk) adds to the diagonal
    block of every M_xy the exact per-pair terms of the key blocks that do not fit."""
    I, i0, BK, nk, flags = _fix_frame(refs, Kp)

    @pl.when(_count_unfit(flags, I, nk) > 0)
    def _():
        def block(kb, dia):
            cols = pl.ds(kb * BK, BK)
            xs = {x: refs[x][pl.ds(i0, SUB), cols].astype(F32) for x in XS}
            loc, _ = _sub_gates(refs, i0, cols)
            dd = _diag_scores(refs, xs, loc, i0, cols)
            fit = _flag(flags, I * nk + kb)
            return tuple(dia[n] + jnp.where(fit, 0.0, dd[n]) for n in range(len(PAIRS)))

        dia = blocks(nk, block, tuple(jnp.zeros((SUB, SUB), F32) for _ in PAIRS))
        blk = (pl.ds(i0, SUB), pl.ds(i0, SUB))
        for n, (x, y) in enumerate(PAIRS):
            ref = refs[f"M_{x}{y}"]
            ref[blk] = (ref[blk].astype(F32) + dia[n]).astype(ref.dtype)


def _fix_bwd_kernel(refs, Kp):
    """DIAG "split", backward: one program per (slot, head, sub-chunk) adds the exact
    in-sub-chunk pair gradients of the key blocks that do not fit to dr, da, db, dk and to
    pq (P - Q of the dw assembly), in place."""
    I, i0, BK, nk, flags = _fix_frame(refs, Kp)

    @pl.when(_count_unfit(flags, I, nk) > 0)
    def _():
        sub = pl.ds(i0, SUB)
        q = {p: refs[f"dM_{p[0]}{p[1]}"][sub, sub].astype(F32) for p in PAIRS}

        def block(kb, carry):
            cols = pl.ds(kb * BK, BK)
            xs = {x: refs[x][sub, cols].astype(F32) for x in XS}
            ys = {y: refs[y][sub, cols].astype(F32) for y in YS}
            loc, _ = _sub_gates(refs, i0, cols)
            keep = jnp.logical_not(_flag(flags, I * nk + kb))
            dx, dy = _diag_grads(refs, xs, q, loc, i0, cols)
            dx = {x: jnp.where(keep, d, 0.0) for x, d in zip(XS, dx)}
            dy = {y: jnp.where(keep, d, 0.0) for y, d in zip(YS, dy)}
            for x in XS:
                ref = refs[f"d{x}"]
                ref[sub, cols] = (ref[sub, cols].astype(F32) + dx[x]).astype(ref.dtype)
            for y in YS:
                ref = refs[f"d{y}"]
                ref[sub, cols] = (ref[sub, cols].astype(F32) + dy[y]).astype(ref.dtype)
            refs["pq"][sub, cols] = (refs["pq"][sub, cols] + sum(xs[x] * dx[x] for x in XS)
                                     - sum(ys[y] * dy[y] for y in YS))
            return carry

        blocks(nk, block)


# the token-major arrays (the inputs [S, BT, H, Kp] and their gradients); the rest head-major
TOKEN_MAJOR = ("r", "k", "a", "b", "w", "dr", "dk", "da", "db", "pq", "c_end")


def _fix(kernel, ins, fixed, name):
    """Runs a fix kernel on grid (S, H, BT / SUB): ins [(name, array, spec)] read (the specs
    are replaced: every program sees its slot and head's whole blocks); fixed {name: array}
    updated in place. Returns {name: array}."""
    S, BT, H, _ = ins[0][1].shape

    def spec(n, a):
        if n in TOKEN_MAJOR:
            return pl.BlockSpec((None, BT, None, a.shape[-1]), lambda s, h, i: (s, 0, h, 0))
        return pl.BlockSpec((None, None) + a.shape[2:],
                            lambda s, h, i: (s, h) + (0,) * (a.ndim - 2))
    io = [(n + "_in", a, spec(n, a)) for n, a in fixed.items()]
    outs = [(n, jax.ShapeDtypeStruct(a.shape, a.dtype), spec(n, a)) for n, a in fixed.items()]
    return call(kernel, (S, H, BT // SUB), [(n, a, spec(n, a)) for n, a, _ in ins] + io,
                outs, FIX_LAUNCH, name, aliases={n + "_in": n for n in fixed})


def _slot_spec(S, H, BT, D):
    return pl.BlockSpec((None, None, BT, D), lambda s, h: (s, h, 0, 0))


def _tok_spec(BT, D):
    """A slot's rows of one head in the token-major layout [S, BT, H, D]."""
    return pl.BlockSpec((None, BT, None, D), lambda s, h: (s, 0, h, 0))


def _vec_spec(D):
    return pl.BlockSpec((None, None, D), lambda s, h: (s, h, 0))


def _call(kernel, ins, outs, grid, name, kind):
    """pallas_call of a scores kernel at WARPS[kind] warps and STAGES[kind] stages."""
    names = [n for n, _, _ in ins] + [n for n, _, _ in outs]

    def body(*refs):
        kernel(dict(zip(names, refs)))

    res = pl.pallas_call(body, grid=grid, in_specs=[s for _, _, s in ins],
                         out_specs=[s for _, _, s in outs],
                         out_shape=[a for _, a, _ in outs],
                         compiler_params=ptr.compiler_params(WARPS[kind], STAGES[kind]),
                         interpret=ptr.interpret(), name=name)(*[a for _, a, _ in ins])
    return dict(zip([n for n, _, _ in outs], res))


def _forward(r, k, a, b, w, prec):
    """(the nine outputs of dplr_scores, the DIAG "split" flags int32 [S, H, BT / SUB * Kp /
    BK] or None)."""
    if DIAG not in DIAGS:
        raise ValueError(f"dplr_scores: DIAG={DIAG!r}; expected one of {DIAGS}")
    S, BT, H, Kp = r.shape
    sd = ptr.store_dtype(prec)          # M_rb, M_rk, M_ak and the vectors: BF16 products only
    vec = lambda: jax.ShapeDtypeStruct((S, H, BT, Kp), sd)      # noqa: E731
    mat = lambda p: jax.ShapeDtypeStruct((S, H, BT, BT), F32 if p == ("a", "b") else sd)  # noqa
    ins = [(n, x, _tok_spec(BT, Kp)) for n, x in
           (("r", r), ("k", k), ("a", a), ("b", b), ("w", w))]
    outs = [(f"M_{x}{y}", mat((x, y)), _slot_spec(S, H, BT, BT)) for x, y in PAIRS]
    outs += [(f"{x}_in", vec(), _slot_spec(S, H, BT, Kp)) for x in XS]
    outs += [(f"{y}_out", vec(), _slot_spec(S, H, BT, Kp)) for y in YS]
    outs += [("tot", jax.ShapeDtypeStruct((S, H, Kp), F32), _vec_spec(Kp))]
    n_out = len(outs)
    if DIAG == "split":
        nf = (BT // SUB) * (Kp // _bk(Kp))
        outs += [("fits", jax.ShapeDtypeStruct((S, H, nf), jnp.int32), _vec_spec(nf))]
    res = _call(lambda refs: _fwd_kernel(refs, BT, Kp, prec), ins, outs, (S, H),
                "dplr_scores_fwd", "fwd")
    fits = res.get("fits")
    if fits is not None:
        res.update(_fix(lambda refs: _fix_fwd_kernel(refs, Kp), ins + [("fits", fits, None)],
                        {f"M_{x}{y}": res[f"M_{x}{y}"] for x, y in PAIRS}, "dplr_scores_fix_fwd"))
    return tuple(res[n] for n, _, _ in outs[:n_out]), fits


# ----------------------------------------------------------------------------- backward
def _bwd_kernel(refs, BT, Kp, prec):
    """Every gradient in one kernel: dr, dk, da, db, pq = P - Q, c_end, g_tot (a row-side and
    a column-side kernel, as Triton's, measured slower: RESULTS.md run 12)."""
    BK = _bk(Kp)
    nk, nb = Kp // BK, BT // SUB
    rows = lax.broadcasted_iota(jnp.int32, (BT, 1), 0)
    eye = (lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
           == lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1))
    split = "fits" in refs
    flags = refs["fits"][...] if split else None

    def block(kb, carry):
        cols = pl.ds(kb * BK, BK)
        G, L = _chunk_gates(refs, cols, BT, BK)
        refs["g_tot"][cols] = refs["d_tot"][cols] * jnp.exp(L.value())

        def sub_chunk(I, carry):
            i0 = I * SUB
            sub = pl.ds(i0, SUB)
            xs = {x: refs[x][sub, cols].astype(F32) for x in XS}
            ys = {y: refs[y][sub, cols].astype(F32) for y in YS}
            loc, tot_I = _sub_gates(refs, i0, cols)
            R = _before(G, i0)
            q = {p: refs[f"dM_{p[0]}{p[1]}"][sub, sub].astype(F32) for p in PAIRS}
            if split:
                dx, dy = _diag_grads_dot(xs, ys, q, loc, _flag(flags, I * nk + kb), prec,
                                         {p: refs[f"dM_{p[0]}{p[1]}"].dtype for p in PAIRS})
            else:
                dx, dy = _diag_grads(refs, xs, q, loc, i0, cols)
            dg = {p: jnp.sum(jnp.where(eye, q[p], 0.0), axis=1)[:, None] for p in PAIRS}
            # row side: pairs with earlier rows (the rows of I; none for I = 0)
            e_c = gt.masked_exp(gt.gap(gt.bcast(R), G), rows < i0)
            e_r = jnp.exp(loc.value())
            cy = {y: refs[y][:, cols].astype(F32) * e_c for y in YS}
            gx = {x: e_r * sum(ptr.dot(refs[f"dM_{x}{y}"][sub, :], cy[y], (1, 0), prec)
                               for y in YS) for x in XS}
            gx = {x: gx[x] + d for x, d in zip(XS, dx)}
            eG = jnp.exp(gt.add(gt.bcast(R), loc).value())
            bx = {x: refs[f"d{x}_in"][sub, cols].astype(F32) * eG for x in XS}
            P = sum(xs[x] * (gx[x] + bx[x]) for x in XS)
            for x in XS:
                ref = refs[f"d{x}"]
                ref[sub, cols] = (gx[x] + bx[x] + sum(dg[x, y] * ys[y] for y in YS)
                                  ).astype(ref.dtype)
            # column side: pairs with later rows (the columns of I, reference its last row;
            # none for the last sub-chunk)
            Gl = gt.row(G, i0 + SUB - 1)
            e_w = gt.masked_exp(gt.gap(G, gt.bcast(Gl)), rows >= i0 + SUB)
            e_l = jnp.exp(gt.gap(gt.bcast(tot_I), loc))                     # [SUB, BK]
            wx = {x: refs[x][:, cols].astype(F32) * e_w for x in XS}
            gy = {y: e_l * sum(ptr.dot(refs[f"dM_{x}{y}"][:, sub], wx[x], (0, 0), prec)
                               for x in XS) for y in YS}
            gy = {y: gy[y] + d for y, d in zip(YS, dy)}
            Q = sum(ys[y] * gy[y] for y in YS)
            e_e = jnp.exp(gt.span(L, R, loc))                                # exp(L - G)
            by = {y: refs[f"d{y}_out"][sub, cols].astype(F32) * e_e for y in YS}
            refs["c_end"][sub, cols] = sum(ys[y] * by[y] for y in YS)
            for y in YS:
                ref = refs[f"d{y}"]
                ref[sub, cols] = (gy[y] + by[y] + sum(dg[x, y] * xs[x] for x in XS)
                                  ).astype(ref.dtype)
            refs["pq"][sub, cols] = P - Q
            return carry

        lax.fori_loop(0, nb, sub_chunk, 0)
        return carry

    lax.fori_loop(0, nk, block, 0)


def _backward(r, k, a, b, w, fits, cts, prec):
    """fits: the forward's flags (DIAG "split") or None (every diagonal pair exact)."""
    S, BT, H, Kp = r.shape
    dM = dict(zip(PAIRS, cts[:4]))
    d_in = dict(zip(XS, cts[4:6]))
    d_out = dict(zip(YS, cts[6:8]))
    d_tot = cts[8]
    vspec = _slot_spec(S, H, BT, Kp)
    tspec = _tok_spec(BT, Kp)
    ins = [(n, x, tspec) for n, x in (("r", r), ("k", k), ("a", a), ("b", b), ("w", w))]
    ins += [(f"dM_{x}{y}", dM[x, y], _slot_spec(S, H, BT, BT)) for x, y in PAIRS]
    ins += [(f"d{x}_in", d_in[x], vspec) for x in XS]
    ins += [(f"d{y}_out", d_out[y], vspec) for y in YS]
    ins += [("d_tot", d_tot, _vec_spec(Kp))]
    if fits is not None:
        ins += [("fits", fits, _vec_spec(fits.shape[-1]))]
    # the input gradients in their inputs' dtypes (r, k: bf16 for a BF16 problem), the rest fp32
    dts = {"dr": r.dtype, "dk": k.dtype, "da": a.dtype, "db": b.dtype}
    tvec = lambda n: jax.ShapeDtypeStruct((S, BT, H, Kp), dts.get(n, F32))  # noqa: E731
    g_tot = [("g_tot", jax.ShapeDtypeStruct((S, H, Kp), F32), _vec_spec(Kp))]
    outs = [(n, tvec(n), tspec) for n in ("dr", "dk", "da", "db", "pq", "c_end")] + g_tot
    res = _call(lambda refs: _bwd_kernel(refs, BT, Kp, prec), ins, outs, (S, H),
                "dplr_scores_bwd", "bwd")
    if fits is not None:
        res.update(_fix(lambda refs: _fix_bwd_kernel(refs, Kp), ins[:9] + ins[-1:],
                        {n: res[n] for n in ("dr", "dk", "da", "db", "pq")},
                        "dplr_scores_fix_bwd"))
    # dw_s = sum_{t >= s} (P_t - Q_t) + sum_{j < s} c_end_j + dtot exp(L)
    pq, c_end = res["pq"], res["c_end"]
    suffix = jnp.flip(jnp.cumsum(jnp.flip(pq, 1), axis=1), 1)
    # strict prefix as a shifted cumsum (cumsum - c_end would add and subtract the O(1)
    # term of the chunk's last row)
    prefix = jnp.pad(jnp.cumsum(c_end[:, :-1], axis=1), ((0, 0), (1, 0), (0, 0), (0, 0)))
    dw = suffix + prefix + res["g_tot"][:, None, :, :]
    return res["dr"], res["dk"], res["da"], res["db"], dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def dplr_scores(r, k, a, b, w, prec):
    """(r, k, a_s, b, w) [S, BT, H, Kp] (token-major; a_s: a shifted up one row), fp32 (r, k
    may be bf16: read as fp32; their gradients come back in their dtypes) ->
    (M_rb, M_rk, M_ab, M_ak [S, H, BT, BT], r_in, a_in, b_out, k_out [S, H, BT, Kp],
    tot [S, H, Kp]), fp32 except, for prec ptr.BF16, M_rb, M_rk, M_ak and the four vectors
    in bf16 (ptr.store_dtype: every later use is a BF16 product; M_ab stays fp32 for the WY
    inversion) (see the module docstring). prec: the fp32 dot precision
    (ptr.SPLIT3: three bf16 products, for 16-bit problems).
    The module's DIAG (one of DIAGS) picks how the diagonal blocks are formed."""
    return _forward(r, k, a, b, w, prec)[0]


def _fwd(r, k, a, b, w, prec):
    outs, fits = _forward(r, k, a, b, w, prec)
    return outs, (r, k, a, b, w, fits)


def _bwd(prec, res, cts):
    r, k, a, b, w, fits = res       # cts in their outputs' dtypes (the kernels read either)
    return _backward(r, k, a, b, w, fits, cts, prec)


dplr_scores.defvjp(_fwd, _bwd)
