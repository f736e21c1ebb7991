"""Chunk-parallel backward of the per-key-gated delta rule's output and scores (Triton): dq, dk
and dg in one kernel, one program per (chunk slot, head, K block).

Inputs (b the in-chunk cumsum of the log-decay, split hi + lo; L = b at the chunk's end):
vn (delta_state.delta_state_fwd), h / dh (the state before / its gradient after each chunk),
dAqk = scale do vn^T and dAk (the key scores' gradient) and dkb (the gradient of k exp(b)) from
wy.wy_bwd. Per token and key channel:
    dq_s  = scale exp(b) do h^T                 dk_s = exp(L - b) vn dh^T
    dq_a  = sum_{j <= i} dAqk_ij exp(b_i - b_j) k_j              (rows)
    dk_a  = sum_{j < i} dAk_ij exp(b_i - b_j) k_j                 (rows)
          + sum_{i >= j} (dAqk_ij q_i + dAk_ij k_i) exp(b_i - b_j)  (columns, `dk_c`)
    dq = dq_s + dq_a,    dk = dk_s + dk_a + dkb exp(b)
    x  = q (dq_s + dq_a) + k (dk_rows - dk_c) + dkb k exp(b),   r = k dk_s
         (the pairs i == j of Aqk left out of x: their q_i dAqk_ii k_i - k_i dAqk_ii q_i is 0)
    dg_s = exp(L) <h, dh>_row + sum_{t < s} r_t + sum_{t >= s} x_t
(x: the gradient of b at the token, r: the part through exp(L - b) carried to L.)
The score sums run per sub-chunk I of 16 rows: the other sub-chunks through the row just
before / after I (the 16-bit operand keeps its largest entries undecayed), the diagonal
sub-block through I's first row when the decay across I stays under gates.SPAN (fp32-accurate
dots), else exact per pair. They are parked in fp32 scratch rows (slot layout) and read back
as one [BT, BK] tile after a barrier (LAUNCH SCRATCH=True), or placed into [BT, BK] register
tiles by a broadcast-reshape-select (SCRATCH=False).
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
# Launch parameters for 16-bit inputs (fp32: BK = BV = 32, 4 warps, one stage); a tuning script
# may override entries.
# SCRATCH: the per-sub-chunk score sums go through fp32 scratch rows (else they are placed into
# [BT, BK] register tiles with a broadcast-reshape-select).
LAUNCH = dict(BK=64, BV=64, num_warps=8, SCRATCH=True)


@triton.jit
def _row(x, t, i_h, eos, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    return tl.load(x + (t * H + i_h) * K + o_k, mask=m_k & (o_k * 0 + t < eos),
                   other=0.).to(tl.float32)


@triton.jit
def _intra(q, k, ch, cl, dAqk, dAk, q_f, k_f, hi_f, lo_f, c0, eos, base, i_h, o_k, m_k,
           s_dq, s_dk, s_db, I: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
           BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, SCRATCH: tl.constexpr):
    """Score sums (dq, dk, db) [BC, BK] of sub-chunk I (its 16 rows), returned and, with
    SCRATCH, stored to the scratch rows s_dq, s_dk, s_db."""
    dt = q.dtype.element_ty
    NC: tl.constexpr = BT // BC
    i0 = I * BC
    o_c = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    t_I = c0 + i0 + o_c
    s_I = base + i0 + o_c
    m_Ik = (t_I < eos)[:, None] & m_k[None, :]
    p_I = (t_I[:, None] * H + i_h) * K + o_k[None, :]
    q_I = tl.load(q + p_I, mask=m_Ik, other=0.).to(tl.float32)
    k_I = tl.load(k + p_I, mask=m_Ik, other=0.).to(tl.float32)
    hi_I, lo_I = load_cum(ch, cl, s_I, i_h, o_k, m_k, H, K, 2, BC)
    p_rows = (s_I[:, None] * H + i_h) * BT
    dq_I = q_I * 0.
    dkr_I = q_I * 0.
    dkc_I = q_I * 0.
    if I > 0:
        r_hi, r_lo = load_cum_row(ch, cl, base + i0 - 1, i_h, o_k, m_k, H, K, 2)
        e_k = tl.where(o_t[:, None] < i0, gap(r_hi[None, :], r_lo[None, :], hi_f, lo_f),
                       float("-inf"))
        k_d = (k_f * tl.exp(e_k)).to(dt)
        left = o_t[None, :] < i0
        aq = tl.where(left, tl.load(dAqk + p_rows + o_t[None, :]), 0.).to(dt)
        ak = tl.where(left, tl.load(dAk + p_rows + o_t[None, :]), 0.).to(dt)
        d_r = tl.exp(gap(hi_I, lo_I, r_hi[None, :], r_lo[None, :]))
        dq_I += tl.dot(aq, k_d, input_precision=PREC) * d_r
        dkr_I += tl.dot(ak, k_d, input_precision=PREC) * d_r
    if I < NC - 1:
        n_hi, n_lo = load_cum_row(ch, cl, base + i0 + BC, i_h, o_k, m_k, H, K, 2)
        e_q = tl.where(o_t[:, None] >= i0 + BC, gap(hi_f, lo_f, n_hi[None, :], n_lo[None, :]),
                       float("-inf"))
        d_q = tl.exp(e_q)
        below = o_t[None, :] >= i0 + BC
        p_cols = (base + o_t[None, :]) * H * BT + i_h * BT + i0 + o_c[:, None]
        aqt = tl.where(below, tl.load(dAqk + p_cols), 0.).to(dt)
        akt = tl.where(below, tl.load(dAk + p_cols), 0.).to(dt)
        acc = tl.dot(aqt, (q_f * d_q).to(dt), input_precision=PREC)
        acc += tl.dot(akt, (k_f * d_q).to(dt), input_precision=PREC)
        dkc_I += acc * tl.exp(gap(n_hi[None, :], n_lo[None, :], hi_I, lo_I))
    f_hi, f_lo = load_cum_row(ch, cl, base + i0, i_h, o_k, m_k, H, K, 2)
    e_f = gap(hi_I, lo_I, f_hi[None, :], f_lo[None, :])     # <= 0
    if tl.max(-e_f) < SPAN:
        ef = tl.exp(e_f)
        fe = tl.exp(-e_f)
        p_d = p_rows + i0 + o_c[None, :]
        aq_d = tl.where(o_c[:, None] > o_c[None, :], tl.load(dAqk + p_d), 0.)
        ak_d = tl.where(o_c[:, None] > o_c[None, :], tl.load(dAk + p_d), 0.)
        k_u = k_I * fe
        dq_I += ef * tl.dot(aq_d, k_u, input_precision="tf32x3")
        dkr_I += ef * tl.dot(ak_d, k_u, input_precision="tf32x3")
        dkc_I += (tl.dot(tl.trans(aq_d), q_I * ef, input_precision="tf32x3")
                  + tl.dot(tl.trans(ak_d), k_I * ef, input_precision="tf32x3")) * fe
    else:
        for j in range(BC):
            t_j = c0 + i0 + j
            h_j, l_j = load_cum_row(ch, cl, base + i0 + j, i_h, o_k, m_k, H, K, 2)
            k_j = _row(k, t_j, i_h, eos, o_k, m_k, H, K)
            q_j = _row(q, t_j, i_h, eos, o_k, m_k, H, K)
            c_q = tl.load(dAqk + (s_I * H + i_h) * BT + i0 + j)
            c_k = tl.load(dAk + (s_I * H + i_h) * BT + i0 + j)
            e_j = tl.where(o_c[:, None] >= j, gap(hi_I, lo_I, h_j[None, :], l_j[None, :]),
                           float("-inf"))
            x_j = k_j[None, :] * tl.exp(e_j)
            dq_I += tl.where(o_c > j, c_q, 0.)[:, None] * x_j
            dkr_I += tl.where(o_c > j, c_k, 0.)[:, None] * x_j
            s_j = base + i0 + j
            r_q = tl.load(dAqk + (s_j * H + i_h) * BT + i0 + o_c)
            r_k = tl.load(dAk + (s_j * H + i_h) * BT + i0 + o_c)
            e_c = tl.where(o_c[:, None] <= j, gap(h_j[None, :], l_j[None, :], hi_I, lo_I),
                           float("-inf"))
            dkc_I += (tl.where(o_c < j, r_q, 0.)[:, None] * q_j[None, :]
                      + tl.where(o_c < j, r_k, 0.)[:, None] * k_j[None, :]) * tl.exp(e_c)
    # the pairs i == j of Aqk: in dq and dk, not in the gate gradient (q_i dA_ii k_i -
    # k_i dA_ii q_i cancels exactly; formed, it would leave rounding of O(1) terms there)
    d_ii = tl.load(dAqk + (s_I * H + i_h) * BT + i0 + o_c)[:, None]
    r_dq = dq_I + d_ii * k_I
    r_dk = dkr_I + dkc_I + d_ii * q_I
    r_db = q_I * dq_I + k_I * (dkr_I - dkc_I)
    if SCRATCH:
        p_s = (s_I[:, None] * H + i_h) * K + o_k[None, :]
        tl.store(s_dq + p_s, r_dq, mask=m_k[None, :])
        tl.store(s_dk + p_s, r_dk, mask=m_k[None, :])
        tl.store(s_db + p_s, r_db, mask=m_k[None, :])
    return r_dq, r_dk, r_db


@triton.jit
def _place(acc, x, I: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """acc [BT, BK] with its rows of sub-chunk I replaced by x [BC, BK]."""
    x3 = tl.broadcast_to(x[None, :, :], (BT // BC, BC, BK))
    rows = tl.arange(0, BT)
    sel = (rows >= I * BC) & (rows < I * BC + BC)
    return tl.where(sel[:, None], tl.reshape(x3, (BT, BK)), acc)


@triton.jit
def _delta_output_bwd_kernel(q, k, vn, do, h, dh, ch, cl, dAqk, dAk, dkb, s_dq, s_dk, s_db,
                             dq, dk, dg, cu_seqlens, scale, T, N, n_steps, H: tl.constexpr,
                             K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                             BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             REL: tl.constexpr, SCRATCH: tl.constexpr,
                             IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    NKB: tl.constexpr = (K + BK - 1) // BK
    pid = tl.program_id(0)
    i_kb = pid % NKB
    i_h = (pid // NKB) % H
    slot = pid // (NKB * H)
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    t_f = c0 + o_t
    m_f = t_f < eos
    m_fk = m_f[:, None] & m_k[None, :]
    base = slot.to(tl.int64) * BT
    s_f = base + o_t
    p_f = (t_f[:, None] * H + i_h) * K + o_k[None, :]
    q_f = tl.load(q + p_f, mask=m_fk, other=0.).to(tl.float32)
    k_f = tl.load(k + p_f, mask=m_fk, other=0.).to(tl.float32)
    hi_f, lo_f = load_cum(ch, cl, s_f, i_h, o_k, m_k, H, K, 2, BT)
    a_dq = tl.zeros([BT, BK], dtype=tl.float32)
    a_dk = a_dq
    a_db = a_dq
    x_q, x_k, x_b = _intra(q, k, ch, cl, dAqk, dAk, q_f, k_f, hi_f, lo_f, c0, eos, base, i_h,
                           o_k, m_k, s_dq, s_dk, s_db, 0, H, K, BT, BC, PREC, SCRATCH)
    if not SCRATCH:
        a_dq = _place(a_dq, x_q, 0, BT, BC, BK)
        a_dk = _place(a_dk, x_k, 0, BT, BC, BK)
        a_db = _place(a_db, x_b, 0, BT, BC, BK)
    x_q, x_k, x_b = _intra(q, k, ch, cl, dAqk, dAk, q_f, k_f, hi_f, lo_f, c0, eos, base, i_h,
                           o_k, m_k, s_dq, s_dk, s_db, 1, H, K, BT, BC, PREC, SCRATCH)
    if not SCRATCH:
        a_dq = _place(a_dq, x_q, 1, BT, BC, BK)
        a_dk = _place(a_dk, x_k, 1, BT, BC, BK)
        a_db = _place(a_db, x_b, 1, BT, BC, BK)
    x_q, x_k, x_b = _intra(q, k, ch, cl, dAqk, dAk, q_f, k_f, hi_f, lo_f, c0, eos, base, i_h,
                           o_k, m_k, s_dq, s_dk, s_db, 2, H, K, BT, BC, PREC, SCRATCH)
    if not SCRATCH:
        a_dq = _place(a_dq, x_q, 2, BT, BC, BK)
        a_dk = _place(a_dk, x_k, 2, BT, BC, BK)
        a_db = _place(a_db, x_b, 2, BT, BC, BK)
    x_q, x_k, x_b = _intra(q, k, ch, cl, dAqk, dAk, q_f, k_f, hi_f, lo_f, c0, eos, base, i_h,
                           o_k, m_k, s_dq, s_dk, s_db, 3, H, K, BT, BC, PREC, SCRATCH)
    if not SCRATCH:
        a_dq = _place(a_dq, x_q, 3, BT, BC, BK)
        a_dk = _place(a_dk, x_k, 3, BT, BC, BK)
        a_db = _place(a_db, x_b, 3, BT, BC, BK)
    hoff = (slot.to(tl.int64) * H + i_h) * K * V
    dq_s = tl.zeros([BT, BK], dtype=tl.float32)
    dk_s = tl.zeros([BT, BK], dtype=tl.float32)
    ct = tl.zeros([BK], dtype=tl.float32)
    for vb in range(tl.cdiv(V, BV)):
        o_v = vb * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        m_fv = m_f[:, None] & m_v[None, :]
        p_v = (t_f[:, None] * H + i_h) * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_fv, other=0.)
        b_vn = tl.load(vn + p_v, mask=m_fv, other=0.)
        b_h = tl.load(h + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dh + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        dq_s += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        dk_s += tl.dot(b_vn, tl.trans(b_dh), input_precision=PREC)
        ct += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    l_hi, l_lo = load_cum_row(ch, cl, base + BT - 1, i_h, o_k, m_k, H, K, 2)
    # reloaded rather than kept live across the V loop (registers)
    hi_f, lo_f = load_cum(ch, cl, s_f, i_h, o_k, m_k, H, K, 2, BT)
    q_f = tl.load(q + p_f, mask=m_fk, other=0.).to(tl.float32)
    k_f = tl.load(k + p_f, mask=m_fk, other=0.).to(tl.float32)
    e_b = tl.exp(hi_f + lo_f)
    if REL:
        # dkb is the gradient of k exp(b - b_0) (delta_scores' rel)
        z_hi, z_lo = load_cum_row(ch, cl, base, i_h, o_k, m_k, H, K, 2)
        e_k = tl.exp(gap(hi_f, lo_f, z_hi[None, :], z_lo[None, :]))
    else:
        e_k = e_b
    dq_s = dq_s * (scale * e_b)
    dk_s = dk_s * tl.exp(gap(l_hi[None, :], l_lo[None, :], hi_f, lo_f))
    # the score sums of every sub-chunk, stored above by this program
    if SCRATCH:
        tl.debug_barrier()
        p_s = (s_f[:, None] * H + i_h) * K + o_k[None, :]
        a_dq = tl.load(s_dq + p_s, mask=m_k[None, :], other=0., cache_modifier=".cg")
        a_dk = tl.load(s_dk + p_s, mask=m_k[None, :], other=0., cache_modifier=".cg")
        a_db = tl.load(s_db + p_s, mask=m_k[None, :], other=0., cache_modifier=".cg")
    b_dkb = tl.load(dkb + p_f, mask=m_fk, other=0.)
    tl.store(dq + p_f, (dq_s + a_dq).to(dq.dtype.element_ty), mask=m_fk)
    tl.store(dk + p_f, (dk_s + a_dk + b_dkb * e_k).to(dk.dtype.element_ty), mask=m_fk)
    x = q_f * dq_s + a_db + b_dkb * k_f * e_k
    # r of the chunk's last token never enters dg (sum over t < s): kept out of the cumsum,
    # where it would be added and subtracted again (its O(1) rounding left in dg)
    r = tl.where(t_f[:, None] == tl.minimum(c0 + BT, eos) - 1, 0., k_f * dk_s)
    w = (ct * tl.exp(l_hi + l_lo))[None, :] + (tl.cumsum(r, axis=0) - r) \
        + (tl.sum(x, axis=0)[None, :] - tl.cumsum(x, axis=0) + x)
    tl.store(dg + p_f, w, mask=m_fk)


def delta_output_bwd(q, k, vn, do, h, dh, cum, dAqk, dAk, dkb, scale: float, cu_seqlens,
                     prec: str, alloc, rel: bool = False):
    """(dq, dk [B, T, H, K] in q's dtype, dg [B, T, H, K] fp32): see the module docstring.
    q, k [B, T, H, K], vn, do [B, T, H, V] (one dtype); h, dh [slots, H, K, V]; cum = (hi, lo)
    the split cumsum; dAqk, dAk [slots * BT, H, BT] fp32; dkb [B, T, H, K] fp32 (with rel:
    the gradient of k exp(b - b_0), delta_scores' rel)."""
    B, T, H, K = q.shape
    V = vn.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = n_slots(B, T, N, BT, cu_seqlens is not None)
    wide = q.dtype == torch.float32
    BK = min(block(K), 32 if wide else LAUNCH["BK"])
    BV = min(block(V), 32 if wide else LAUNCH["BV"])
    scratch = LAUNCH["SCRATCH"]
    s_dq = alloc((S * BT, H, K), torch.float32) if scratch else q
    s_dk = alloc((S * BT, H, K), torch.float32) if scratch else q
    s_db = alloc((S * BT, H, K), torch.float32) if scratch else q
    dq = alloc(q.shape, q.dtype)
    dk = alloc(k.shape, k.dtype)
    dg = alloc(q.shape, torch.float32)
    # one program per (slot, head, K block), the K blocks of a chunk launched next to each
    # other (they read the same dA, do, vn rows)
    _delta_output_bwd_kernel[(S * H * triton.cdiv(K, BK),)](
        q, k, vn, do, h, dh, cum[0], cum[1], dAqk, dAk, dkb, s_dq, s_dk, s_db, dq, dk, dg,
        cu_seqlens if cu_seqlens is not None else q, scale, T, N, search_steps(N), H=H, K=K,
        V=V, BT=BT, BC=BC, BK=BK, BV=BV, REL=rel, SCRATCH=scratch,
        IS_VARLEN=cu_seqlens is not None, PREC=prec,
        num_warps=4 if wide else LAUNCH["num_warps"], num_stages=1 if wide else 2)
    return dq, dk, dg
