"""Per-key-gated WY (UT) transform of the delta rule (Pallas, Triton lowering), forward and
backward, one program per (chunk slot, head): the mirror of fla_torch/ops/common/engine/wy.py.

With Ak the key scores (delta_scores.py) and kb = k exp(b - b_0) (b the in-chunk cumsum of
the per-key log-decay, b_0 its first row), per chunk of BT = 64 rows:
    Akk = diag(beta) Ak (strictly lower),   T = (I + Akk)^-1   (fp32, kept for the backward)
    w   = T diag(beta) kb,                  u = T diag(beta) v   (in the input dtype)
so that vn = u - w (diag(exp(b_0)) h) (delta_state.py). T is formed from the 16x16 blocks of
Akk: the diagonal blocks by forward substitution (inv_unit_lower, a lax.fori_loop),
T_IJ = -T_II sum_{J <= M < I} Akk_IM T_MJ below them. Products of fp32 factors: at the engine's
fp32-accurate precision for fp32 problems; for 16-bit ones on bf16 tensor cores through hi + lo
splits (pallas_triton.split_matmul / split_matmul32, ~2^-16 relative, as the Triton engine).

Backward, from dvn (the gradient of vn, fp32) and h (the state before the chunk), with
dw = -dvn (diag(exp(b_0)) h)^T the gradient of the relative w:
    dT = (dw kb^T + dvn v^T) diag(beta)
    dv = diag(beta) T^T dvn,   dkb = diag(beta) T^T dw   (the gradient of the relative kb)
    dAkk = -strict(T^T dT T^T),   dAk = diag(beta) dAkk
    dbeta = rowsum((T^T dw) * kb) + rowsum((T^T dvn) * v) + rowsum(dAkk * Ak)
The backward walks V in blocks of BV_BWD, then K in blocks of BK_BWD (lax.fori_loops, as
Triton's wy_bwd): dw = -(dvn h^T) diag(exp(b_0)) per K block, h in its own dtype.
Shapes: Ak, T, dAk [slots, H, BT, BT] fp32; kb, dkb [B, T, H, K]; v, u, dv [B, T, H, V];
w [B, T, H, K]; beta, dbeta [B, T, H] fp32; h [slots, H, Kp, Vp]; dvn [B, T, H, V] fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .. import pallas_triton as ptr
from . import specs
from .launch import SUB, Launch, Problem, call
from .output_stage import _chunk, _parallel_inputs, _row

F32 = jnp.float32
LAUNCH = Launch(None, None, 4, 1)


def _beta_spec(pb):
    from . import varlen as vl
    batch = vl.batch_of_slot(pb.varlen, pb.T, pb.bt)
    return pl.BlockSpec((None, pb.T, None), lambda s, h, j: (batch(s), 0, h))


def _sq_spec(pb):
    return specs.slot_state(pb.bt, pb.bt, specs.zero, specs.zero)


def _sq(pb):
    return jax.ShapeDtypeStruct((pb.n_slots, pb.H, pb.bt, pb.bt), F32)


def inv_unit_lower(As):
    """[(I + A)^-1 for A in As] (strictly lower [SUB, SUB] fp32 blocks) by forward substitution
    in exact fp32 FMAs, the blocks side by side in one lax.fori_loop over the rows (one copy
    of the body in the IR)."""
    r = jnp.arange(SUB)[:, None]
    c = jnp.arange(SUB)
    eye = (r == c[None, :]).astype(F32)

    def body(i, Ts):
        out = []
        for A, Tb in zip(As, Ts):
            a_i = jnp.sum(jnp.where(r == i, A, 0.0), axis=0)                 # row i of A
            new = jnp.where(c == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * Tb, axis=0)
            out.append(jnp.where(r == i, new[None, :], Tb))
        return tuple(out)

    return list(lax.fori_loop(1, SUB, body, tuple(eye for _ in As)))


def _blk(ref, I, J):
    return ref[pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)]


def _fwd_kernel(refs, pb):
    start, nv = _chunk(refs, pb)
    nb = pb.bt // SUB
    prec = pb.precision
    split = refs["v"].dtype != F32          # 16-bit problem: fp32 products as bf16 splits
    betas = [ptr.load_rows(refs["beta"], start + I * SUB, SUB, nv - I * SUB).astype(F32)
             for I in range(nb)]
    a = {(I, J): betas[I][:, None] * _blk(refs["Ak"], I, J)
         for I in range(nb) for J in range(I + 1)}
    Tm = dict(zip([(I, I) for I in range(nb)],
                  inv_unit_lower([a[I, I] for I in range(nb)])))
    for d in range(1, nb):
        for I in range(d, nb):
            J = I - d
            acc = None
            for M in range(J, I):
                x = ptr.split_matmul32(a[I, M], Tm[M, J], (1, 0), prec, split)
                acc = x if acc is None else acc + x
            Tm[I, J] = -ptr.split_matmul32(Tm[I, I], acc, (1, 0), prec, split)
    z = jnp.zeros((SUB, SUB), F32)
    for I in range(nb):
        for J in range(nb):
            refs["T"][pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)] = Tm[I, J] if J <= I else z
    rows = [(start + I * SUB, nv - I * SUB) for I in range(nb)]
    for name, src, n_cols in (("w", "kb", pb.K), ("u", "v", pb.V)):
        xs = [ptr.load_rows(refs[src], rs, SUB, nvI, n_cols) for rs, nvI in rows]
        for I in range(nb):
            acc = None
            for J in range(I + 1):
                x = ptr.split_matmul(Tm[I, J] * betas[J][None, :], xs[J], (1, 0), prec)
                acc = x if acc is None else acc + x
            ptr.store_rows(refs[name], rows[I][0], rows[I][1], n_cols, acc)


def wy_fwd(pb: Problem, Ak, kb, v, beta, cu, seq):
    """Ak [slots, H, BT, BT] fp32, kb [B, T, H, K], v [B, T, H, V] (one dtype), beta
    [B, T, H] fp32. Returns (T [slots, H, BT, BT] fp32, w [B, T, H, K], u [B, T, H, V] in
    v's dtype)."""
    par = dict(parallel=True)
    ins = [("Ak", Ak, _sq_spec(pb)),
           ("kb", kb, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("v", v, specs.seq_rows(pb, pb.Vp, specs.zero, **par)),
           ("beta", beta, _beta_spec(pb))]
    ins += _parallel_inputs(pb, cu, seq)
    outs = [("T", _sq(pb), _sq_spec(pb)),
            ("w", jax.ShapeDtypeStruct(kb.shape, v.dtype),
             specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
            ("u", jax.ShapeDtypeStruct(v.shape, v.dtype),
             specs.seq_rows(pb, pb.Vp, specs.zero, **par))]
    r = call(lambda refs: _fwd_kernel(refs, pb), (pb.n_slots, pb.H, 1), ins, outs, LAUNCH,
             "kda_wy_fwd")
    return r["T"], r["w"], r["u"]


BV_BWD = 64        # V and K blocks of the backward (h [BK, BV] tiles as dot operands)


BK_BWD = 64


def _bwd_kernel(refs, pb):
    """Triton's order: dT, du = T^T dvn, dv over V blocks; then per K block dw =
    -(dvn h^T) exp(b_0), dT += dw kb^T, dkb = beta T^T dw (H100 bf16 K=V=128: 0.50 ms; the
    former whole-Kp dw carried across the V blocks with tf32x3 products: 1.92 ms)."""
    start, nv = _chunk(refs, pb)
    prec = pb.precision
    bt = pb.bt
    split = refs["v"].dtype != F32          # 16-bit problem: fp32 x fp32 products split
    bv, bk = min(pb.Vp, BV_BWD), min(pb.Kp, BK_BWD)
    Tm = refs["T"][...]
    beta = ptr.load_rows(refs["beta"], start, bt, nv).astype(F32)

    def ld(name, c0, w, n_cols):
        return ptr.load_block(refs[name], start, bt, nv, c0, w, n_cols)

    def v_block(j, carry):
        dT, db = carry
        c0 = j * bv
        v, dvn = ld("v", c0, bv, pb.V), ld("dvn", c0, bv, pb.V)
        dT = dT + ptr.split_matmul(dvn, v, (1, 1), prec)                    # dvn v^T
        du = ptr.split_matmul32(Tm, dvn, (0, 0), prec, split)                # T^T dvn
        ptr.store_block(refs["dv"], start, nv, c0, pb.V, (du * beta[:, None]).astype(v.dtype))
        return dT, db + jnp.sum(du * v.astype(F32), axis=1)

    def k_block(i, carry):
        dT, db = carry
        k0 = i * bk

        def h_block(j, dw):
            c0 = j * bv
            h = refs["h"][pl.ds(k0, bk), pl.ds(c0, bv)]
            return dw - ptr.split_matmul(ld("dvn", c0, bv, pb.V), h, (1, 1), prec)

        e0 = jnp.exp(_row(refs["g"], start, nv > 0, pb.K, k0, bk))          # exp(b_0) [bk]
        dw = lax.fori_loop(0, pl.cdiv(pb.V, bv), h_block, jnp.zeros((bt, bk), F32)) * e0[None, :]
        kb = ld("kb", k0, bk, pb.K)
        dT = dT + ptr.split_matmul(dw, kb, (1, 1), prec)
        dW = ptr.split_matmul32(Tm, dw, (0, 0), prec, split)                 # T^T dw
        ptr.store_block(refs["dkb"], start, nv, k0, pb.K, dW * beta[:, None])
        return dT, db + jnp.sum(dW * kb.astype(F32), axis=1)

    carry = lax.fori_loop(0, pl.cdiv(pb.V, bv), v_block,
                          (jnp.zeros((bt, bt), F32), jnp.zeros((bt,), F32)))
    dT, db = lax.fori_loop(0, pl.cdiv(pb.K, bk), k_block, carry)
    dT = dT * beta[None, :]
    ii = jnp.arange(bt)[:, None]
    jj = jnp.arange(bt)[None, :]
    dA = -ptr.split_matmul32(ptr.split_matmul32(Tm, dT, (0, 0), prec, split), Tm, (1, 1), prec,
                             split)
    dA = jnp.where(ii > jj, dA, 0.0)
    db = db + jnp.sum(dA * jnp.where(ii > jj, refs["Ak"][...], 0.0), axis=1)
    ptr.store_rows(refs["dbeta"], start, nv, None, db)
    refs["dAk"][...] = dA * beta[:, None]


def wy_bwd(pb: Problem, Ak, T, kb, v, beta, g, h, dvn, cu, seq):
    """Ak, T [slots, H, BT, BT] fp32; kb [B, T, H, K], v [B, T, H, V] (one dtype); beta
    [B, T, H] fp32; g [B, T, H, K] fp32 (for exp(b_0)); h [slots, H, Kp, Vp] (the state
    before each chunk); dvn [B, T, H, V] fp32. Returns (dv [B, T, H, V] in v's dtype, dbeta
    [B, T, H] fp32, dkb [B, T, H, K] fp32, dAk [slots, H, BT, BT] fp32)."""
    par = dict(parallel=True)
    ins = [("Ak", Ak, _sq_spec(pb)), ("T", T, _sq_spec(pb)),
           ("kb", kb, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("v", v, specs.seq_rows(pb, pb.Vp, specs.zero, **par)),
           ("beta", beta, _beta_spec(pb)),
           ("g", g, specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
           ("h", h, specs.slot_state(pb.Kp, pb.Vp, specs.zero, specs.zero)),
           ("dvn", dvn, specs.seq_rows(pb, pb.Vp, specs.zero, **par))]
    ins += _parallel_inputs(pb, cu, seq)
    outs = [("dv", jax.ShapeDtypeStruct(v.shape, v.dtype),
             specs.seq_rows(pb, pb.Vp, specs.zero, **par)),
            ("dbeta", jax.ShapeDtypeStruct(beta.shape, F32), _beta_spec(pb)),
            ("dkb", jax.ShapeDtypeStruct(kb.shape, F32),
             specs.seq_rows(pb, pb.Kp, specs.zero, **par)),
            ("dAk", _sq(pb), _sq_spec(pb))]
    r = call(lambda refs: _bwd_kernel(refs, pb), (pb.n_slots, pb.H, 1), ins, outs, LAUNCH,
             "kda_wy_bwd")
    return r["dv"], r["dbeta"], r["dkb"], r["dAk"]
