"""Key-gate forward front stage (Triton): the gate cumsum and the intra-chunk scores of one
chunk in one program, with every tile of the chunk held in registers.

One program per (chunk slot, head), per key block of BK channels:
    b = cumsum(g) over the chunk (fp64), w = cumsum(g) within each sub-chunk of BC rows (fp64),
    p_I = b just before sub-chunk I (so b_i = p_I + w_i for row i of sub-chunk I);
    A_ij = sum_c q_ic k_jc exp(b_ic - b_jc)   (j <= i, 0 above the diagonal), fp32:
      earlier sub-chunks J < I: (q_i exp(w_i)) . (k_j exp(p_I - b_j)), one tensor-core dot per
        I with every exponent <= 0 (16-bit operands in q's dtype, fp32-accurate for fp32);
      the diagonal sub-blocks: (q_i exp(w_i)) . (k_j exp(-w_j)) as one fp32-accurate (3xTF32)
        dot when the decay within every sub-chunk stays under gates.SPAN (the factors stay in
        [e^-SPAN, e^SPAN], exact fp32 numbers), else exact per pair from b.
Written: A [slots * BT, H, BT] fp32 (scores.intra_scores' layout), qg = q exp(b) and
kg = k exp(last - b) [B, T, H, K] in q's dtype, el = exp(last) [slots, H, K] fp32 and, when
the backward needs it, the split cumsum (hi, lo) [slots * BT, H, K] (gates.chunk_cumsum's
layout). The gate cumsum never goes through memory on its way to A.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gates import SPAN, split
from .launch import launch_for
from .scores import _load_row
from .varlen import n_slots, search_steps, slot_chunk


@triton.jit
def _cumsum_scores_kernel(q, k, g, A, qg, kg, el, ch, cl, cu_seqlens, T, N, n_steps,
                          H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                          BK: tl.constexpr, STORE_CUM: tl.constexpr, IS_VARLEN: tl.constexpr,
                          PREC: tl.constexpr):
    slot, i_h = tl.program_id(0), tl.program_id(1)
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    NK: tl.constexpr = (K + BK - 1) // BK
    NC: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    o_s = tl.arange(0, NC)
    sub = o_t // BC
    t = c0 + o_t
    m_t = t < eos
    srow = slot.to(tl.int64) * BT + o_t
    A_off = tl.zeros([BT, BT], dtype=tl.float32)
    A_dia = tl.zeros([BT, BT], dtype=tl.float32)
    causal_sub = (o_t[:, None] >= o_t[None, :]) & (sub[:, None] == sub[None, :])
    for kb in range(NK):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_x = (t[:, None] * H + i_h) * K + o_k[None, :]
        x = tl.load(g + p_x, mask=m_tk, other=0.).to(tl.float64)
        x3 = tl.reshape(x, [NC, BC, BK])
        w3 = tl.cumsum(x3, axis=1)
        s_I = tl.sum(x3, axis=1)
        p_I = tl.cumsum(s_I, axis=0) - s_I                      # [NC, BK]: b before sub-chunk I
        b = tl.reshape(w3 + p_I[:, None, :], [BT, BK])
        w = tl.reshape(w3, [BT, BK])
        last = tl.sum(s_I, axis=0)                              # [BK]
        b_q = tl.load(q + p_x, mask=m_tk, other=0.)
        b_k = tl.load(k + p_x, mask=m_tk, other=0.)
        tl.store(qg + p_x, (b_q * tl.exp(b.to(tl.float32))).to(dt), mask=m_tk)
        tl.store(kg + p_x, (b_k * tl.exp((last[None, :] - b).to(tl.float32))).to(dt),
                 mask=m_tk)
        tl.store(el + (slot.to(tl.int64) * H + i_h) * K + o_k, tl.exp(last.to(tl.float32)),
                 mask=m_k)
        if STORE_CUM:
            hi, lo = split(b)
            p_c = (srow[:, None] * H + i_h) * K + o_k[None, :]
            tl.store(ch + p_c, hi, mask=m_k[None, :])
            tl.store(cl + p_c, lo, mask=m_k[None, :])
        ew = tl.exp(w.to(tl.float32))                           # <= 1
        q_d = (b_q * ew).to(dt)
        for I in tl.static_range(1, NC):
            pI = tl.sum(tl.where(o_s[:, None] == I, p_I, 0.), axis=0)
            e_k = tl.where(sub[:, None] < I, (pI[None, :] - b).to(tl.float32), float("-inf"))
            k_d = (b_k * tl.exp(e_k)).to(dt)
            q_I = tl.where(sub[:, None] == I, q_d, 0.).to(dt)
            A_off += tl.dot(q_I, tl.trans(k_d), input_precision=PREC)
        q_32 = b_q.to(tl.float32)
        if tl.max(-w) < SPAN:
            a = tl.dot(q_32 * ew, tl.trans(b_k.to(tl.float32) / ew), input_precision="tf32x3")
            A_dia += tl.where(causal_sub, a, 0.)
        else:
            for j in range(BT):
                k_j = _load_row(k, c0 + j, i_h, eos, o_k, m_k, H, K)
                b_j = tl.sum(tl.where(o_t[:, None] == j, b, 0.), axis=0)
                e = tl.where((o_t[:, None] >= j) & (sub[:, None] == j // BC),
                             (b - b_j[None, :]).to(tl.float32), float("-inf"))
                a_j = tl.sum(q_32 * k_j[None, :] * tl.exp(e), axis=1)
                A_dia += tl.where(o_t[None, :] == j, a_j[:, None], 0.)
    tl.store(A + (srow[:, None] * H + i_h) * BT + o_t[None, :], A_off + A_dia)


def cumsum_scores(q, k, g, cu_seqlens, prec: str, alloc, store_cum: bool = True):
    """q, k [B, T, H, K] (one dtype), g [B, T, H, K] fp32 log-decay.
    Returns (cum, kg, el, A, qg): cum = (hi, lo) [slots * BT, H, K] fp32 or None unless
    store_cum; kg = k exp(last - b), qg = q exp(b) [B, T, H, K] in q's dtype; el = exp(last)
    [slots, H, K] fp32; A [slots * BT, H, BT] fp32 (see the module docstring)."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cfg = launch_for("cumsum_scores", K, K, q.dtype)
    S = n_slots(B, T, N, cfg.BT, cu_seqlens is not None)
    A = alloc((S * cfg.BT, H, cfg.BT), torch.float32)
    qg, kg = alloc(q.shape, q.dtype), alloc(k.shape, k.dtype)
    el = alloc((S, H, K), torch.float32)
    cum = None
    if store_cum:
        cum = (alloc((S * cfg.BT, H, K), torch.float32), alloc((S * cfg.BT, H, K), torch.float32))
    ch, cl = cum if cum is not None else (el, el)
    _cumsum_scores_kernel[(S, H)](
        q, k, g, A, qg, kg, el, ch, cl, cu_seqlens if cu_seqlens is not None else q, T, N,
        search_steps(N), H=H, K=K, BT=cfg.BT, BC=cfg.BC, BK=cfg.BK, STORE_CUM=store_cum,
        IS_VARLEN=cu_seqlens is not None, PREC=prec, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return cum, kg, el, A, qg
