"""Intra-chunk scores of the per-key-gated delta rule (Triton): both score matrices in one pass.

    Aqk_ij = sum_c q_ic k_jc exp(b_ic - b_jc)   (j <= i)
    Ak_ij  = sum_c k_ic k_jc exp(b_ic - b_jc)   (j < i)
b the in-chunk cumsum of the per-key log-decay, split in fp32 hi + lo (gates.chunk_cumsum).
One program per (chunk slot, head) writes Aqk and Ak (fp32, slot layout [slots * BT, H, BT],
zero above the diagonal; Ak's diagonal is zero too) and qg = q exp(b), kb = k exp(b)
([B, T, H, K], the input dtype). The two matrices share every decay factor: for the rows of
sub-chunk I (BC rows, f its first row) the columns of earlier sub-chunks go through one
16-bit tensor-core dot each, with (q_i | k_i) exp(b_i - b_f) and k_j exp(b_f - b_j) (every
exponent <= 0); the diagonal sub-block goes through f too when the decay across the sub-chunk
stays under gates.SPAN (fp32-accurate dots of exact fp32 factors, see scores.py), else exact
per pair from the split cumsum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gates import SPAN, gap, load_cum, load_cum_row
from .launch import block
from .varlen import n_slots, search_steps, slot_chunk

BT = 64
BC = 16
# Launch parameters for 16-bit inputs (fp32: BK 16, 4 warps, one stage: the GLA engine's fp32
# scores spilled registers at BK 32 on sm_90); a tuning script may override entries.
LAUNCH = dict(BK=32, num_warps=8)


@triton.jit
def _row(x, t, i_h, eos, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    """Row [BK] fp32 of token t of x [B*T, H, K]; 0 at t >= eos."""
    return tl.load(x + (t * H + i_h) * K + o_k, mask=m_k & (o_k * 0 + t < eos),
                   other=0.).to(tl.float32)


@triton.jit
def _sub_chunk(q, k, ch, cl, k_f, hi_f, lo_f, c0, eos, base, i_h, o_k, m_k,
               I: tl.constexpr, aq, ak, dq, dk, H: tl.constexpr, K: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Adds one K block's share to the off-diagonal rows (aq, ak [BC, BT]) and the diagonal
    sub-blocks (dq, dk [BC, BC]) of sub-chunk I."""
    dt = q.dtype.element_ty
    i0 = I * BC
    o_c = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    t_I = c0 + i0 + o_c
    m_Ik = (t_I < eos)[:, None] & m_k[None, :]
    p_I = (t_I[:, None] * H + i_h) * K + o_k[None, :]
    q_I = tl.load(q + p_I, mask=m_Ik, other=0.).to(tl.float32)
    k_I = tl.load(k + p_I, mask=m_Ik, other=0.).to(tl.float32)
    hi_I, lo_I = load_cum(ch, cl, base + i0 + o_c, i_h, o_k, m_k, H, K, 2, BC)
    f_hi, f_lo = load_cum_row(ch, cl, base + i0, i_h, o_k, m_k, H, K, 2)
    e_f = gap(hi_I, lo_I, f_hi[None, :], f_lo[None, :])     # <= 0
    d_f = tl.exp(e_f)
    if I > 0:
        e_k = tl.where(o_t[:, None] < i0, gap(f_hi[None, :], f_lo[None, :], hi_f, lo_f),
                       float("-inf"))
        k_c = tl.trans((k_f * tl.exp(e_k)).to(dt))
        aq += tl.dot((q_I * d_f).to(dt), k_c, input_precision=PREC)
        ak += tl.dot((k_I * d_f).to(dt), k_c, input_precision=PREC)
    if tl.max(-e_f) < SPAN:
        k_u = tl.trans(k_I * tl.exp(-e_f))
        dq += tl.dot(q_I * d_f, k_u, input_precision="tf32x3")
        dk += tl.dot(k_I * d_f, k_u, input_precision="tf32x3")
    else:
        for j in range(BC):
            k_j = _row(k, c0 + i0 + j, i_h, eos, o_k, m_k, H, K)
            h_j, l_j = load_cum_row(ch, cl, base + i0 + j, i_h, o_k, m_k, H, K, 2)
            e = tl.where(o_c[:, None] >= j, gap(hi_I, lo_I, h_j[None, :], l_j[None, :]),
                         float("-inf"))
            x = k_j[None, :] * tl.exp(e)
            dq += tl.where(o_c[None, :] == j, tl.sum(q_I * x, axis=1)[:, None], 0.)
            dk += tl.where(o_c[None, :] == j, tl.sum(k_I * x, axis=1)[:, None], 0.)
    return aq, ak, dq, dk


@triton.jit
def _store_rows(A, base, i_h, I: tl.constexpr, off, dia, STRICT: tl.constexpr,
                H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i0 = I * BC
    o_c = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    p = A + ((base + i0 + o_c)[:, None] * H + i_h) * BT
    tl.store(p + o_t[None, :], tl.where(o_t[None, :] < i0, off, 0.),
             mask=(o_t[None, :] < i0) | (o_t[None, :] >= i0 + BC))
    if STRICT:
        keep = o_c[:, None] > o_c[None, :]
    else:
        keep = o_c[:, None] >= o_c[None, :]
    tl.store(p + i0 + o_c[None, :], tl.where(keep, dia, 0.))


@triton.jit
def _delta_scores_kernel(q, k, ch, cl, Aqk, Ak, qg, kb, qgr, e0, cu_seqlens, T, N, n_steps,
                         H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                         BK: tl.constexpr, REL: tl.constexpr, IS_VARLEN: tl.constexpr,
                         PREC: tl.constexpr):
    slot, i_h = tl.program_id(0), tl.program_id(1)
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    base = slot.to(tl.int64) * BT
    t_f = c0 + o_t
    m_f = t_f < eos
    zo = tl.zeros([BC, BT], dtype=tl.float32)
    zd = tl.zeros([BC, BC], dtype=tl.float32)
    aq0, ak0, dq0, dk0 = zo, zo, zd, zd
    aq1, ak1, dq1, dk1 = zo, zo, zd, zd
    aq2, ak2, dq2, dk2 = zo, zo, zd, zd
    aq3, ak3, dq3, dk3 = zo, zo, zd, zd
    for kb_i in range(tl.cdiv(K, BK)):
        o_k = kb_i * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_fk = m_f[:, None] & m_k[None, :]
        p_f = (t_f[:, None] * H + i_h) * K + o_k[None, :]
        hi_f, lo_f = load_cum(ch, cl, base + o_t, i_h, o_k, m_k, H, K, 2, BT)
        e_b = tl.exp(hi_f + lo_f)
        k_f = tl.load(k + p_f, mask=m_fk, other=0.)
        q_f = tl.load(q + p_f, mask=m_fk, other=0.)
        tl.store(qg + p_f, (q_f * e_b).to(dt), mask=m_fk)
        if REL:
            # relative to the chunk's first row: exp(b - b_0) and exp(b_0) (fp16 range)
            z_hi, z_lo = load_cum_row(ch, cl, base, i_h, o_k, m_k, H, K, 2)
            e_r = tl.exp(gap(hi_f, lo_f, z_hi[None, :], z_lo[None, :]))
            tl.store(kb + p_f, (k_f * e_r).to(dt), mask=m_fk)
            tl.store(qgr + p_f, (q_f * e_r).to(dt), mask=m_fk)
            tl.store(e0 + (slot.to(tl.int64) * H + i_h) * K + o_k, tl.exp(z_hi + z_lo),
                     mask=m_k)
        else:
            tl.store(kb + p_f, (k_f * e_b).to(dt), mask=m_fk)
        k_f = k_f.to(tl.float32)
        aq0, ak0, dq0, dk0 = _sub_chunk(q, k, ch, cl, k_f, hi_f, lo_f, c0, eos, base, i_h, o_k,
                                        m_k, 0, aq0, ak0, dq0, dk0, H, K, BT, BC, PREC)
        aq1, ak1, dq1, dk1 = _sub_chunk(q, k, ch, cl, k_f, hi_f, lo_f, c0, eos, base, i_h, o_k,
                                        m_k, 1, aq1, ak1, dq1, dk1, H, K, BT, BC, PREC)
        aq2, ak2, dq2, dk2 = _sub_chunk(q, k, ch, cl, k_f, hi_f, lo_f, c0, eos, base, i_h, o_k,
                                        m_k, 2, aq2, ak2, dq2, dk2, H, K, BT, BC, PREC)
        aq3, ak3, dq3, dk3 = _sub_chunk(q, k, ch, cl, k_f, hi_f, lo_f, c0, eos, base, i_h, o_k,
                                        m_k, 3, aq3, ak3, dq3, dk3, H, K, BT, BC, PREC)
    _store_rows(Aqk, base, i_h, 0, aq0, dq0, False, H, BT, BC)
    _store_rows(Aqk, base, i_h, 1, aq1, dq1, False, H, BT, BC)
    _store_rows(Aqk, base, i_h, 2, aq2, dq2, False, H, BT, BC)
    _store_rows(Aqk, base, i_h, 3, aq3, dq3, False, H, BT, BC)
    _store_rows(Ak, base, i_h, 0, ak0, dk0, True, H, BT, BC)
    _store_rows(Ak, base, i_h, 1, ak1, dk1, True, H, BT, BC)
    _store_rows(Ak, base, i_h, 2, ak2, dk2, True, H, BT, BC)
    _store_rows(Ak, base, i_h, 3, ak3, dk3, True, H, BT, BC)


def delta_scores(q, k, cum, cu_seqlens, prec: str, alloc, rel: bool = False):
    """(Aqk, Ak [slots * BT, H, BT] fp32, qg = q exp(b), kb = k exp(b) [B, T, H, K] in q's
    dtype, qgr, e0) from q, k [B, T, H, K] and the split cumsum cum = (hi, lo) of a per-key
    gate (gates.chunk_cumsum). rel (fp16: exp(b) of strong gates is subnormal there): kb is
    k exp(b - b_0) instead, qgr = q exp(b - b_0) and e0 = exp(b_0) [slots, H, K] fp32 (b_0: b
    at the chunk's first row); else qgr, e0 are None."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = n_slots(B, T, N, BT, cu_seqlens is not None)
    wide = q.dtype == torch.float32
    Aqk = alloc((S * BT, H, BT), torch.float32)
    Ak = alloc((S * BT, H, BT), torch.float32)
    qg = alloc(q.shape, q.dtype)
    kb = alloc(k.shape, k.dtype)
    qgr = alloc(q.shape, q.dtype) if rel else None
    e0 = alloc((S, H, K), torch.float32) if rel else None
    _delta_scores_kernel[(S, H)](
        q, k, cum[0], cum[1], Aqk, Ak, qg, kb, qgr if rel else qg, e0 if rel else Aqk,
        cu_seqlens if cu_seqlens is not None else q, T, N, search_steps(N), H=H, K=K, BT=BT,
        BC=BC, REL=rel,
        BK=min(block(K), 16 if wide else LAUNCH["BK"]),
        IS_VARLEN=cu_seqlens is not None, PREC=prec,
        num_warps=4 if wide else LAUNCH["num_warps"],
        num_stages=1 if wide else 2)
    return Aqk, Ak, qg, kb, qgr, e0
