"""Intra-chunk scores (Triton), computed once per chunk and head, with the gate switch.

    A_ij = sum_c q_ic k_jc exp(b_ic - b_jc)   (j <= i, 0 above the diagonal)

b the in-chunk cumsum of the log-decay (gates.chunk_cumsum; per key channel c for the key
gate). One program per (chunk slot, head) writes A, fp32, in the slot layout
[slots * BT, H, BT] (row = slot * BT + i, column = j within the chunk), sub-chunk I of BC rows
after sub-chunk, and qg = q exp(b) [B, T, H, K] in q's dtype (the output stage's operand).
The columns of earlier sub-chunks factor through I's first row f (q_i exp(b_i - b_f),
k_j exp(b_f - b_j): every exponent <= 0) into one tensor-core dot. The diagonal sub-block
factors through its own first row f too when the decay across it stays under gates.SPAN (every
channel's b_f - b_last < SPAN: the factors exp(b_f - b_j) <= e^SPAN and exp(b_i - b_f) >=
e^-SPAN are exact fp32 numbers, so an fp32-accurate (3xTF32) dot of them gives each pair
q_i . k_j exp(b_i - b_j) to fp32 accuracy); beyond it (strong gates), exact per pair from the
split cumsum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gates import SPAN, gap, load_cum, load_cum_row
from .launch import launch_for
from .varlen import n_slots, search_steps, slot_chunk


@triton.jit
def _load_row(x, t, i_h, eos, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    """Row [BK] (fp32) of token t of x [B*T, H, K]; 0 at t >= eos."""
    return tl.load(x + (t * H + i_h) * K + o_k, mask=m_k & (o_k * 0 + t < eos),
                   other=0.).to(tl.float32)


@triton.jit
def _scores_kernel(q, k, ch, cl, A, qg, cu_seqlens, T, N, n_steps, H: tl.constexpr,
                   K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                   GATE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    slot, i_h = tl.program_id(0), tl.program_id(1)
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    NK: tl.constexpr = (K + BK - 1) // BK
    NC: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    base = slot.to(tl.int64) * BT
    t_f = c0 + o_t
    m_f = t_f < eos
    s_f = base + o_t
    for kb in range(NK):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_f = (t_f[:, None] * H + i_h) * K + o_k[None, :]
        m_fk = m_f[:, None] & m_k[None, :]
        hi_f, lo_f = load_cum(ch, cl, s_f, i_h, o_k, m_k, H, K, GATE, BT)
        b_q = tl.load(q + p_f, mask=m_fk, other=0.)
        tl.store(qg + p_f, (b_q * tl.exp(hi_f + lo_f)).to(dt), mask=m_fk)
    for I in tl.static_range(NC):
        i0 = I * BC
        t_I = c0 + i0 + o_c
        m_I = t_I < eos
        s_I = base + i0 + o_c
        A_off = tl.zeros([BC, BT], dtype=tl.float32)
        A_dia = tl.zeros([BC, BC], dtype=tl.float32)
        for kb in range(NK):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            q_I = tl.load(q + (t_I[:, None] * H + i_h) * K + o_k[None, :],
                          mask=m_I[:, None] & m_k[None, :], other=0.)
            hi_I, lo_I = load_cum(ch, cl, s_I, i_h, o_k, m_k, H, K, GATE, BC)
            if I > 0:
                k_f = tl.load(k + (t_f[:, None] * H + i_h) * K + o_k[None, :],
                              mask=m_f[:, None] & m_k[None, :], other=0.)
                hi_f, lo_f = load_cum(ch, cl, s_f, i_h, o_k, m_k, H, K, GATE, BT)
                f_hi, f_lo = load_cum_row(ch, cl, base + i0, i_h, o_k, m_k, H, K, GATE)
                q_d = (q_I * tl.exp(gap(hi_I, lo_I, f_hi[None, :], f_lo[None, :]))).to(dt)
                e_k = tl.where(o_t[:, None] < i0, gap(f_hi[None, :], f_lo[None, :], hi_f, lo_f),
                               float("-inf"))
                k_d = (k_f * tl.exp(e_k)).to(dt)
                A_off += tl.dot(q_d, tl.trans(k_d), input_precision=PREC)
            q_32 = q_I.to(tl.float32)
            d_hi, d_lo = load_cum_row(ch, cl, base + i0, i_h, o_k, m_k, H, K, GATE)
            e_f = gap(hi_I, lo_I, d_hi[None, :], d_lo[None, :])     # <= 0
            if tl.max(-e_f) < SPAN:
                k_I = tl.load(k + (t_I[:, None] * H + i_h) * K + o_k[None, :],
                              mask=m_I[:, None] & m_k[None, :], other=0.).to(tl.float32)
                a = tl.dot(q_32 * tl.exp(e_f), tl.trans(k_I * tl.exp(-e_f)),
                           input_precision="tf32x3")
                A_dia += tl.where(o_c[:, None] >= o_c[None, :], a, 0.)
            else:
                for j in range(BC):
                    k_j = _load_row(k, c0 + i0 + j, i_h, eos, o_k, m_k, H, K)
                    h_j, l_j = load_cum_row(ch, cl, base + i0 + j, i_h, o_k, m_k, H, K, GATE)
                    e = tl.where(o_c[:, None] >= j, gap(hi_I, lo_I, h_j[None, :], l_j[None, :]),
                                 float("-inf"))
                    a = tl.sum(q_32 * k_j[None, :] * tl.exp(e), axis=1)
                    A_dia += tl.where(o_c[None, :] == j, a[:, None], 0.)
        p_I = A + (s_I[:, None] * H + i_h) * BT
        m_off = (o_t[None, :] < i0) | (o_t[None, :] >= i0 + BC)
        tl.store(p_I + o_t[None, :], A_off, mask=m_off)
        tl.store(p_I + i0 + o_c[None, :], A_dia)


def intra_scores(q, k, cum, gate: int, cu_seqlens, prec: str, alloc):
    """(A [slots * BT, H, BT] fp32, qg [B, T, H, K] in q's dtype): see the module docstring.
    q, k [B, T, H, K]; cum: the split cumsum (gates.chunk_cumsum, None for GATE_NONE)."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cfg = launch_for("scores", K, K, q.dtype)
    S = n_slots(B, T, N, cfg.BT, cu_seqlens is not None)
    A = alloc((S * cfg.BT, H, cfg.BT), torch.float32)
    qg = alloc(q.shape, q.dtype)
    ch, cl = cum if cum is not None else (q, q)
    _scores_kernel[(S, H)](
        q, k, ch, cl, A, qg, cu_seqlens if cu_seqlens is not None else q, T, N,
        search_steps(N), H=H, K=K, BT=cfg.BT, BC=cfg.BC, BK=cfg.BK, GATE=gate,
        IS_VARLEN=cu_seqlens is not None, PREC=prec, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return A, qg
