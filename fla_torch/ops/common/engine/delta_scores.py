"""Intra-chunk scores of the per-key-gated delta rule (Triton): both score matrices in one pass.

    Aqk_ij = sum_c q_ic k_jc exp(b_ic - b_jc)   (j <= i)
    Ak_ij  = sum_c k_ic k_jc exp(b_ic - b_jc)   (j < i)
b the in-chunk cumsum of the per-key log-decay, split in fp32 hi + lo (gates.chunk_cumsum).
One program per (chunk slot, head, sub-chunk) writes its BC rows of Aqk and Ak (fp32, slot
layout [slots * BT, H, BT], zero above the diagonal; Ak's diagonal is zero too) and of
qg = q exp(b), kb = k exp(b) ([B, T, H, K], the input dtype). The two matrices share every
decay factor: for the rows of sub-chunk I (BC rows, f its first row) the columns of earlier
sub-chunks go through one
16-bit tensor-core dot each, with (q_i | k_i) exp(b_i - b_f) and k_j exp(b_f - b_j) (every
exponent <= 0); the diagonal sub-block goes through f too when the decay across the sub-chunk
stays under gates.SPAN (fp32-accurate dots of exact fp32 factors, see scores.py), else exact
per pair from the split cumsum. The diagonal block is a second pass over K: held next to the
off-diagonal accumulators, its fp32 dots and per-pair loop spilled registers on sm_90.
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
# H100, bf16, B4 T4096 H16 K128: BK 16 / 2 warps 1.15 ms, 16 / 4 1.31 ms, 32 / 4 1.44 ms,
# 32 / 8 2.82 ms (one program per chunk and head, 32 / 8: 2.24 ms).
LAUNCH = dict(BK=16, num_warps=2)


@triton.jit
def _row(x, t, i_h, eos, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    """Row [BK] fp32 of token t of x [B*T, H, K]; 0 at t >= eos."""
    return tl.load(x + (t * H + i_h) * K + o_k, mask=m_k & (o_k * 0 + t < eos),
                   other=0.).to(tl.float32)


@triton.jit
def _sub_tiles(q, k, ch, cl, t_I, m_I, srow, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
               BC: tl.constexpr):
    """One K block of sub-chunk rows t_I (slot row srow onward): (offsets p_I, mask m_Ik, q and
    k in their dtype [BC, BK], the split cumsum hi, lo [BC, BK] and at the sub-chunk's first
    row f_hi, f_lo [BK])."""
    m_Ik = m_I[:, None] & m_k[None, :]
    p_I = (t_I[:, None] * H + i_h) * K + o_k[None, :]
    q_I = tl.load(q + p_I, mask=m_Ik, other=0.)
    k_I = tl.load(k + p_I, mask=m_Ik, other=0.)
    hi_I, lo_I = load_cum(ch, cl, srow + tl.arange(0, BC), i_h, o_k, m_k, H, K, 2, BC)
    f_hi, f_lo = load_cum_row(ch, cl, srow, i_h, o_k, m_k, H, K, 2)
    return p_I, m_Ik, q_I, k_I, hi_I, lo_I, f_hi, f_lo


@triton.jit
def _store_off(A, base, i_h, i0, off, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Rows i0 .. i0 + BC of A outside their diagonal block: off [BC, BT] left of it, zeros
    right of it."""
    o_c = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    p = A + ((base + i0 + o_c)[:, None] * H + i_h) * BT
    tl.store(p + o_t[None, :], tl.where(o_t[None, :] < i0, off, 0.),
             mask=(o_t[None, :] < i0) | (o_t[None, :] >= i0 + BC))


@triton.jit
def _store_diag(A, base, i_h, i0, dia, STRICT: tl.constexpr, H: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr):
    """The diagonal block of rows i0 .. i0 + BC of A: dia's lower triangle (STRICT: without
    the diagonal itself), zeros above."""
    o_c = tl.arange(0, BC)
    p = A + ((base + i0 + o_c)[:, None] * H + i_h) * BT
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
    # one program per (chunk slot, head, sub-chunk I): the rows i0 .. i0 + BC of both matrices
    slot, i_h, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    base = slot.to(tl.int64) * BT
    i0 = i_s * BC
    o_c = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    t_I = c0 + i0 + o_c
    m_I = t_I < eos
    m_j = o_t < i0                       # the rows of the earlier sub-chunks
    t_j = c0 + o_t
    aq = tl.zeros([BC, BT], dtype=tl.float32)
    ak = tl.zeros([BC, BT], dtype=tl.float32)
    for kb_i in range(tl.cdiv(K, BK)):
        o_k = kb_i * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_I, m_Ik, q_I, k_I, hi_I, lo_I, f_hi, f_lo = _sub_tiles(
            q, k, ch, cl, t_I, m_I, base + i0, i_h, o_k, m_k, H, K, BC)
        e_b = tl.exp(hi_I + lo_I)
        tl.store(qg + p_I, (q_I * e_b).to(dt), mask=m_Ik)
        if REL:
            # relative to the chunk's first row: exp(b - b_0) and exp(b_0) (fp16 range)
            z_hi, z_lo = load_cum_row(ch, cl, base, i_h, o_k, m_k, H, K, 2)
            e_r = tl.exp(gap(hi_I, lo_I, z_hi[None, :], z_lo[None, :]))
            tl.store(kb + p_I, (k_I * e_r).to(dt), mask=m_Ik)
            tl.store(qgr + p_I, (q_I * e_r).to(dt), mask=m_Ik)
            if i_s == 0:
                tl.store(e0 + (slot.to(tl.int64) * H + i_h) * K + o_k, tl.exp(z_hi + z_lo),
                         mask=m_k)
        else:
            tl.store(kb + p_I, (k_I * e_b).to(dt), mask=m_Ik)
        d_f = tl.exp(gap(hi_I, lo_I, f_hi[None, :], f_lo[None, :]))     # exponents <= 0
        if i_s > 0:
            # earlier sub-chunks: one 16-bit dot each, through the sub-chunk's first row f
            m_jk = m_j[:, None] & m_k[None, :]
            p_j = ((base + o_t)[:, None] * H + i_h) * K + o_k[None, :]
            hi_j = tl.load(ch + p_j, mask=m_jk, other=0.)
            lo_j = tl.load(cl + p_j, mask=m_jk, other=0.)
            k_j = tl.load(k + (t_j[:, None] * H + i_h) * K + o_k[None, :],
                          mask=m_jk & (t_j < eos)[:, None], other=0.).to(tl.float32)
            e_k = tl.where(m_jk, gap(f_hi[None, :], f_lo[None, :], hi_j, lo_j), float("-inf"))
            k_c = tl.trans((k_j * tl.exp(e_k)).to(dt))
            aq += tl.dot((q_I.to(tl.float32) * d_f).to(dt), k_c, input_precision=PREC)
            ak += tl.dot((k_I.to(tl.float32) * d_f).to(dt), k_c, input_precision=PREC)
    # the diagonal sub-block in a second pass over K (its fp32 dots and the per-pair path
    # would otherwise hold registers next to the off-diagonal accumulators)
    _store_off(Aqk, base, i_h, i0, aq, H, BT, BC)
    _store_off(Ak, base, i_h, i0, ak, H, BT, BC)
    dq = tl.zeros([BC, BC], dtype=tl.float32)
    dk = tl.zeros([BC, BC], dtype=tl.float32)
    for kb_i in range(tl.cdiv(K, BK)):
        o_k = kb_i * BK + tl.arange(0, BK)
        m_k = o_k < K
        _, _, q_I, k_I, hi_I, lo_I, f_hi, f_lo = _sub_tiles(
            q, k, ch, cl, t_I, m_I, base + i0, i_h, o_k, m_k, H, K, BC)
        q_I = q_I.to(tl.float32)
        k_I = k_I.to(tl.float32)
        e_f = gap(hi_I, lo_I, f_hi[None, :], f_lo[None, :])     # <= 0
        d_f = tl.exp(e_f)
        if tl.max(-e_f) < SPAN:
            k_u = tl.trans(k_I * tl.exp(-e_f))
            dq += tl.dot(q_I * d_f, k_u, input_precision="tf32x3")
            dk += tl.dot(k_I * d_f, k_u, input_precision="tf32x3")
        else:
            for j in range(BC):
                k_r = _row(k, c0 + i0 + j, i_h, eos, o_k, m_k, H, K)
                h_r, l_r = load_cum_row(ch, cl, base + i0 + j, i_h, o_k, m_k, H, K, 2)
                e = tl.where(o_c[:, None] >= j, gap(hi_I, lo_I, h_r[None, :], l_r[None, :]),
                             float("-inf"))
                x = k_r[None, :] * tl.exp(e)
                dq += tl.where(o_c[None, :] == j, tl.sum(q_I * x, axis=1)[:, None], 0.)
                dk += tl.where(o_c[None, :] == j, tl.sum(k_I * x, axis=1)[:, None], 0.)
    _store_diag(Aqk, base, i_h, i0, dq, False, H, BT, BC)
    _store_diag(Ak, base, i_h, i0, dk, True, H, BT, BC)


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
    _delta_scores_kernel[(S, H, BT // BC)](
        q, k, cum[0], cum[1], Aqk, Ak, qg, kb, qgr if rel else qg, e0 if rel else Aqk,
        cu_seqlens if cu_seqlens is not None else q, T, N, search_steps(N), H=H, K=K, BT=BT,
        BC=BC, REL=rel,
        BK=min(block(K), 16 if wide else LAUNCH["BK"]),
        IS_VARLEN=cu_seqlens is not None, PREC=prec,
        num_warps=4 if wide else LAUNCH["num_warps"],
        num_stages=1 if wide else 2)
    return Aqk, Ak, qg, kb, qgr, e0
