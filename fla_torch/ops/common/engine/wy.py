"""Per-key-gated WY (UT) transform of the delta rule (Triton), forward and backward, one
program per (chunk slot, head).

With b the in-chunk cumsum of the per-key log-decay (gates.chunk_cumsum) and the key scores
Ak_ij = sum_c k_ic k_jc exp(b_ic - b_jc) (scores.intra_scores on (k, k), slot layout
[slots * BT, H, BT] fp32), per chunk of BT = 64 rows:
    Akk = diag(beta) Ak (strictly lower),   T = (I + Akk)^-1   (fp32, kept for the backward)
    w   = T diag(beta) (k exp(b)),          u = T diag(beta) v   (in the input dtype)
T is formed from the 16x16 blocks of Akk: the diagonal blocks by forward substitution in
registers, T_ij = -T_ii sum_{j <= m < i} Akk_im T_mj below them (fp32-accurate products).
The fp32 factor T diag(beta) multiplies the 16-bit operands as two exact 16-bit products
(split_dot.py).

Backward, from dvn (the gradient of vn = u - w h, fp32) and h (the state before the chunk):
    dw = -dvn h^T,   dT = (dw (k exp(b))^T + dvn v^T) diag(beta)
    dv = diag(beta) T^T dvn,   dkb = diag(beta) T^T dw   (the gradient of k exp(b))
    dAkk = -strict(T^T dT T^T),   dAk = diag(beta) dAkk   (Akk = diag(beta) Ak)
    dbeta = rowsum((T^T dw) * k exp(b)) + rowsum((T^T dvn) * v) + rowsum(dAkk * Ak)
The same program forms dAqk = scale do vn^T (j <= i), the gradient of the output's scores.
dAk, dAqk and dkb go on to delta_bwd.delta_output_bwd.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .split_dot import split_dot, split_dot32, split_dot_wide
from .launch import block
from .varlen import n_slots, search_steps, slot_chunk

BT = 64
# Launch parameters (fwd / bwd of 16-bit operands; fp32 operands: bwd 8 warps); a tuning
# script may override entries. H100 bf16 KDA B4 T4096 H16 K128, fwd+bwd: bwd 4 warps 5.18 ms,
# 8 warps 5.44 ms; fwd 8 warps 2.69 ms, 4 warps 2.25 ms.
LAUNCH = dict(fwd_warps=4, bwd_warps=4)


@triton.jit
def _akk_block(A, base, i_h, r0: tl.constexpr, c0: tl.constexpr, beta_r, H: tl.constexpr,
               BT: tl.constexpr, DIAG: tl.constexpr):
    """16x16 block (rows r0.., columns c0..) of diag(beta) Ak, strictly lower if DIAG."""
    o = tl.arange(0, 16)
    a = tl.load(A + ((base + r0 + o)[:, None] * H + i_h) * BT + c0 + o[None, :])
    if DIAG:
        a = tl.where(o[:, None] > o[None, :], a, 0.)
    return a * beta_r[:, None]


@triton.jit
def _subst(a, t, i, o):
    """Row i of (I + a)^-1 from its rows < i (a strictly lower, 16x16)."""
    sel = o[:, None] == i
    a_r = tl.sum(tl.where(sel, a, 0.), axis=0)
    row = tl.where(o == i, 1., 0.) - tl.sum(a_r[:, None] * t, axis=0)
    return tl.where(sel, row[None, :], t)


@triton.jit
def _store_blk(Tm, base, i_h, r0: tl.constexpr, c0: tl.constexpr, x, H: tl.constexpr,
               BT: tl.constexpr):
    o = tl.arange(0, 16)
    tl.store(Tm + ((base + r0 + o)[:, None] * H + i_h) * BT + c0 + o[None, :], x)


@triton.jit
def _wy_fwd_kernel(Ak, kb, v, beta, Tm, w, u, cu_seqlens, T, N, n_steps, H: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                   PREC32: tl.constexpr):
    slot, i_h = tl.program_id(0), tl.program_id(1)
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    base = slot.to(tl.int64) * BT
    o16 = tl.arange(0, 16)
    b0 = tl.load(beta + (c0 + o16) * H + i_h, mask=c0 + o16 < eos, other=0.)
    b1 = tl.load(beta + (c0 + 16 + o16) * H + i_h, mask=c0 + 16 + o16 < eos, other=0.)
    b2 = tl.load(beta + (c0 + 32 + o16) * H + i_h, mask=c0 + 32 + o16 < eos, other=0.)
    b3 = tl.load(beta + (c0 + 48 + o16) * H + i_h, mask=c0 + 48 + o16 < eos, other=0.)
    a00 = _akk_block(Ak, base, i_h, 0, 0, b0, H, BT, True)
    a11 = _akk_block(Ak, base, i_h, 16, 16, b1, H, BT, True)
    a22 = _akk_block(Ak, base, i_h, 32, 32, b2, H, BT, True)
    a33 = _akk_block(Ak, base, i_h, 48, 48, b3, H, BT, True)
    a10 = _akk_block(Ak, base, i_h, 16, 0, b1, H, BT, False)
    a20 = _akk_block(Ak, base, i_h, 32, 0, b2, H, BT, False)
    a21 = _akk_block(Ak, base, i_h, 32, 16, b2, H, BT, False)
    a30 = _akk_block(Ak, base, i_h, 48, 0, b3, H, BT, False)
    a31 = _akk_block(Ak, base, i_h, 48, 16, b3, H, BT, False)
    a32 = _akk_block(Ak, base, i_h, 48, 32, b3, H, BT, False)
    z = tl.zeros([16, 16], dtype=tl.float32)
    t00 = z
    t11 = z
    t22 = z
    t33 = z
    for i in range(0, 16):
        t00 = _subst(a00, t00, i, o16)
        t11 = _subst(a11, t11, i, o16)
        t22 = _subst(a22, t22, i, o16)
        t33 = _subst(a33, t33, i, o16)
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision=PREC32), input_precision=PREC32)
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision=PREC32), input_precision=PREC32)
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision=PREC32), input_precision=PREC32)
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=PREC32)
                  + tl.dot(a21, t10, input_precision=PREC32), input_precision=PREC32)
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=PREC32)
                  + tl.dot(a32, t21, input_precision=PREC32), input_precision=PREC32)
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=PREC32)
                  + tl.dot(a31, t10, input_precision=PREC32)
                  + tl.dot(a32, t20, input_precision=PREC32), input_precision=PREC32)
    _store_blk(Tm, base, i_h, 0, 0, t00, H, BT)
    _store_blk(Tm, base, i_h, 0, 16, z, H, BT)
    _store_blk(Tm, base, i_h, 0, 32, z, H, BT)
    _store_blk(Tm, base, i_h, 0, 48, z, H, BT)
    _store_blk(Tm, base, i_h, 16, 0, t10, H, BT)
    _store_blk(Tm, base, i_h, 16, 16, t11, H, BT)
    _store_blk(Tm, base, i_h, 16, 32, z, H, BT)
    _store_blk(Tm, base, i_h, 16, 48, z, H, BT)
    _store_blk(Tm, base, i_h, 32, 0, t20, H, BT)
    _store_blk(Tm, base, i_h, 32, 16, t21, H, BT)
    _store_blk(Tm, base, i_h, 32, 32, t22, H, BT)
    _store_blk(Tm, base, i_h, 32, 48, z, H, BT)
    _store_blk(Tm, base, i_h, 48, 0, t30, H, BT)
    _store_blk(Tm, base, i_h, 48, 16, t31, H, BT)
    _store_blk(Tm, base, i_h, 48, 32, t32, H, BT)
    _store_blk(Tm, base, i_h, 48, 48, t33, H, BT)
    # the whole T as one tile: the stores of every thread of the program are visible after
    # the barrier (".cg": read from L2)
    tl.debug_barrier()
    o_t = tl.arange(0, BT)
    t = c0 + o_t
    m_t = t < eos
    b_T = tl.load(Tm + ((base + o_t)[:, None] * H + i_h) * BT + o_t[None, :],
                  cache_modifier=".cg")
    b_b = tl.load(beta + t * H + i_h, mask=m_t, other=0.)
    tb = b_T * b_b[None, :]
    for vb in range(tl.cdiv(V, BV)):
        o_v = vb * BV + tl.arange(0, BV)
        m = m_t[:, None] & (o_v < V)[None, :]
        p = (t[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p, mask=m, other=0.)
        tl.store(u + p, split_dot(tb, b_v, PREC).to(u.dtype.element_ty), mask=m)
    for kb_i in range(tl.cdiv(K, BK)):
        o_k = kb_i * BK + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        p = (t[:, None] * H + i_h) * K + o_k[None, :]
        b_k = tl.load(kb + p, mask=m, other=0.)
        tl.store(w + p, split_dot(tb, b_k, PREC).to(w.dtype.element_ty), mask=m)


def wy_fwd(Ak, kb, v, beta, cu_seqlens, prec: str, prec32: str, alloc):
    """Ak [slots * BT, H, BT] fp32 (key scores), kb = k exp(b) [B, T, H, K], v [B, T, H, V]
    (one dtype), beta [B, T, H] fp32. Returns (Tm [slots * BT, H, BT] fp32, w [B, T, H, K],
    u [B, T, H, V] in v's dtype)."""
    B, T, H, K = kb.shape
    V = v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = n_slots(B, T, N, BT, cu_seqlens is not None)
    wide = v.dtype == torch.float32
    Tm = alloc((S * BT, H, BT), torch.float32)
    w = alloc(kb.shape, v.dtype)
    u = alloc(v.shape, v.dtype)
    _wy_fwd_kernel[(S, H)](
        Ak, kb, v, beta, Tm, w, u, cu_seqlens if cu_seqlens is not None else beta, T, N,
        search_steps(N), H=H, K=K, V=V, BT=BT, BK=min(block(K), 64), BV=min(block(V), 64),
        IS_VARLEN=cu_seqlens is not None, PREC=prec, PREC32=prec32,
        num_warps=LAUNCH["fwd_warps"],
        num_stages=1 if wide else 2)
    return Tm, w, u


@triton.jit
def _wy_bwd_kernel(k, kb, v, beta, Tm, Ak, h, e0, dvn, vn, do, dv, dbeta, dkb, dAk, dAqk,
                   cu_seqlens, scale, T, N, n_steps, REL: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   IS_VARLEN: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
                   PREC32: tl.constexpr):
    slot, i_h = tl.program_id(0), tl.program_id(1)
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    base = slot.to(tl.int64) * BT
    o_t = tl.arange(0, BT)
    t = c0 + o_t
    m_t = t < eos
    p_A = ((base + o_t)[:, None] * H + i_h) * BT + o_t[None, :]
    b_T = tl.load(Tm + p_A)
    b_Tt = tl.trans(b_T)
    b_b = tl.load(beta + t * H + i_h, mask=m_t, other=0.)
    p_h = h + (slot.to(tl.int64) * H + i_h) * K * V
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    dA_o = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    for vb in range(tl.cdiv(V, BV)):
        o_v = vb * BV + tl.arange(0, BV)
        m = m_t[:, None] & (o_v < V)[None, :]
        p = (t[:, None] * H + i_h) * V + o_v[None, :]
        b_do = tl.load(do + p, mask=m, other=0.)
        b_vn = tl.load(vn + p, mask=m, other=0.)
        dA_o += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        b_dvn = tl.load(dvn + p, mask=m, other=0.)
        b_v = tl.load(v + p, mask=m, other=0.)
        dT += split_dot_wide(b_dvn, tl.trans(b_v), PREC)
        b_du = split_dot32(b_Tt, b_dvn, SPLIT, PREC32)
        db += tl.sum(b_du * b_v.to(tl.float32), axis=1)
        tl.store(dv + p, (b_du * b_b[:, None]).to(dv.dtype.element_ty), mask=m)
    for kb_i in range(tl.cdiv(K, BK)):
        o_k = kb_i * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        for vb in range(tl.cdiv(V, BV)):
            o_v = vb * BV + tl.arange(0, BV)
            m_v = o_v < V
            b_dvn = tl.load(dvn + (t[:, None] * H + i_h) * V + o_v[None, :],
                            mask=m_t[:, None] & m_v[None, :], other=0.)
            b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :],
                          mask=m_k[:, None] & m_v[None, :], other=0.)
            if REL:
                b_h = b_h.to(tl.float32) * tl.load(
                    e0 + (slot.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)[:, None]
            b_dw -= split_dot_wide(b_dvn, tl.trans(b_h), PREC)
        m = m_t[:, None] & m_k[None, :]
        p = (t[:, None] * H + i_h) * K + o_k[None, :]
        b_kb = tl.load(kb + p, mask=m, other=0.)
        dT += split_dot_wide(b_dw, tl.trans(b_kb), PREC)
        b_dW = split_dot32(b_Tt, b_dw, SPLIT, PREC32)
        db += tl.sum(b_dW * b_kb.to(tl.float32), axis=1)
        tl.store(dkb + p, b_dW * b_b[:, None], mask=m)
    dT = dT * b_b[None, :]
    dA = -split_dot32(split_dot32(b_Tt, dT, SPLIT, PREC32), b_Tt, SPLIT, PREC32)
    dA = tl.where(o_t[:, None] > o_t[None, :], dA, 0.)
    b_Ak = tl.load(Ak + p_A)
    db += tl.sum(dA * tl.where(o_t[:, None] > o_t[None, :], b_Ak, 0.), axis=1)
    tl.store(dbeta + t * H + i_h, db, mask=m_t)
    tl.store(dAk + p_A, dA * b_b[:, None])
    tl.store(dAqk + p_A, tl.where(o_t[:, None] >= o_t[None, :], dA_o * scale, 0.))


def wy_bwd(k, kb, v, beta, Tm, Ak, h, dvn, vn, do, scale: float, cu_seqlens, prec: str,
           prec32: str, alloc, dv_dtype=None, e0=None):
    """k, kb = k exp(b) [B, T, H, K], v [B, T, H, V] (one dtype), beta [B, T, H] fp32,
    Tm and Ak [slots * BT, H, BT] fp32 (wy_fwd, scores), h [slots, H, K, V] (the state before
    each chunk), dvn [B, T, H, V] fp32; vn, do [B, T, H, V] (the output's value operand and
    gradient). Returns (dv [B, T, H, V] in v's dtype, dbeta [B, T, H] fp32,
    dkb [B, T, H, K] fp32 (the gradient of k exp(b)), dAk [slots * BT, H, BT] fp32 (the
    gradient of the key scores, strictly lower), dAqk [slots * BT, H, BT] fp32
    (= scale do vn^T, the gradient of Aqk, zero above the diagonal)). dv_dtype: dv's dtype
    when it is not v's (fp32 copies of fp16 operands, see kda/triton_chunk.py). e0 [slots, H,
    K] or None: kb and w relative to the chunk's first row (delta_scores' rel; h's rows are
    scaled by e0 in dw, then the returned dkb is the gradient of the relative kb). With e0, h
    must be fp32 (the scaled rows are an fp32 operand)."""
    B, T, H, K = k.shape
    V = v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = n_slots(B, T, N, BT, cu_seqlens is not None)
    wide = v.dtype == torch.float32
    dv = alloc(v.shape, dv_dtype or v.dtype)
    dbeta = alloc(beta.shape, torch.float32)
    dkb = alloc(k.shape, torch.float32)
    dAk = alloc((S * BT, H, BT), torch.float32)
    dAqk = alloc((S * BT, H, BT), torch.float32)
    _wy_bwd_kernel[(S, H)](
        k, kb, v, beta, Tm, Ak, h, e0 if e0 is not None else beta, dvn, vn, do, dv, dbeta, dkb,
        dAk, dAqk, cu_seqlens if cu_seqlens is not None else beta, scale, T, N, search_steps(N),
        REL=e0 is not None, H=H, K=K, V=V, BT=BT, BK=min(block(K), 32 if wide else 64),
        BV=min(block(V), 32 if wide else 64),
        IS_VARLEN=cu_seqlens is not None, SPLIT=not wide, PREC=prec, PREC32=prec32,
        num_warps=8 if wide else LAUNCH["bwd_warps"], num_stages=1 if wide else 2)
    return dv, dbeta, dkb, dAk, dAqk
