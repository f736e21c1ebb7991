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
Written: A [slots * BT, H, BT] in q's dtype (scores.intra_scores' layout; the output stage
rounds A to q's dtype for its dot in any case), qg = q exp(b) and
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
    m_t = o_t < (eos - c0)
    slot = slot.to(tl.int64)
    base = (c0 * H + i_h) * K                   # token rows: base + o_t * H * K + channel
    base_c = (slot * BT * H + i_h) * K          # the same rows in the slot layout
    r_x = o_t[:, None] * (H * K)
    A_acc = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(NK):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        off = r_x + o_k[None, :]
        x3 = tl.reshape(tl.load(g + base + off, mask=m_tk, other=0.).to(tl.float64),
                        [NC, BC, BK])
        w3 = tl.cumsum(x3, axis=1)
        s_J = tl.sum(x3, axis=1)                                # [NC, BK]
        p_e = tl.cumsum(s_J, axis=0)                            # b at the end of sub-chunk J
        p_s = p_e - s_J                                         # b before sub-chunk J
        b = tl.reshape(w3 + p_s[:, None, :], [BT, BK])
        last = tl.sum(s_J, axis=0)
        b_q = tl.load(q + base + off, mask=m_tk, other=0.)
        b_k = tl.load(k + base + off, mask=m_tk, other=0.)
        tl.store(qg + base + off, (b_q * tl.exp(b.to(tl.float32))).to(dt), mask=m_tk)
        tl.store(kg + base + off, (b_k * tl.exp((last[None, :] - b).to(tl.float32))).to(dt),
                 mask=m_tk)
        tl.store(el + (slot * H + i_h) * K + o_k, tl.exp(last.to(tl.float32)), mask=m_k)
        if STORE_CUM:
            hi, lo = split(b)
            tl.store(ch + base_c + off, hi, mask=m_k[None, :])
            tl.store(cl + base_c + off, lo, mask=m_k[None, :])
        w = tl.reshape(w3, [BT, BK]).to(tl.float32)             # b_i - b before i's sub-chunk
        ew = tl.exp(w)
        q_d = (b_q * ew).to(dt)
        for I in tl.static_range(1, NC):
            pI = tl.sum(tl.where(o_s[:, None] == I, p_s, 0.), axis=0)     # b before I
            e_k = tl.where(sub[:, None] < I, (pI[None, :] - b).to(tl.float32), float("-inf"))
            k_d = (b_k * tl.exp(e_k)).to(dt)
            q_I = tl.where(sub[:, None] == I, q_d, 0.).to(dt)
            A_acc += tl.dot(q_I, tl.trans(k_d), input_precision=PREC)
        q_32 = b_q.to(tl.float32)
        if tl.max(-w) < SPAN:
            a = tl.dot(q_32 * ew, tl.trans(b_k.to(tl.float32) * tl.exp(-w)),
                       input_precision="tf32x3")
            A_acc += tl.where((o_t[:, None] >= o_t[None, :]) & (sub[:, None] == sub[None, :]),
                              a, 0.)
        else:
            # exact per pair: b_i - b_j = w_i - w_j within a sub-chunk, from w in fp64 again
            w64 = tl.reshape(tl.cumsum(tl.reshape(
                tl.load(g + base + off, mask=m_tk, other=0.).to(tl.float64), [NC, BC, BK]),
                axis=1), [BT, BK])
            for j in range(BT):
                k_j = _load_row(k, c0 + j, i_h, eos, o_k, m_k, H, K)
                w_j = tl.sum(tl.where(o_t[:, None] == j, w64, 0.), axis=0)
                e = tl.where((o_t[:, None] >= j) & (sub[:, None] == j // BC),
                             (w64 - w_j[None, :]).to(tl.float32), float("-inf"))
                a_j = tl.sum(q_32 * k_j[None, :] * tl.exp(e), axis=1)
                A_acc += tl.where(o_t[None, :] == j, a_j[:, None], 0.)
    tl.store(A + (slot * BT * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :],
             A_acc.to(A.dtype.element_ty))


def cumsum_scores(q, k, g, cu_seqlens, prec: str, alloc, store_cum: bool = True):
    """q, k [B, T, H, K] (one dtype), g [B, T, H, K] fp32 log-decay.
    Returns (cum, kg, el, A, qg): cum = (hi, lo) [slots * BT, H, K] fp32 or None unless
    store_cum; kg = k exp(last - b), qg = q exp(b) [B, T, H, K] in q's dtype; el = exp(last)
    [slots, H, K] fp32; A [slots * BT, H, BT] in q's dtype (see the module docstring)."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cfg = launch_for("cumsum_scores", K, K, q.dtype)
    S = n_slots(B, T, N, cfg.BT, cu_seqlens is not None)
    A = alloc((S * cfg.BT, H, cfg.BT), q.dtype)
    qg, kg = alloc(q.shape, q.dtype), alloc(k.shape, k.dtype)
    el = alloc((S, H, K), torch.float32)
    cum = None
    if store_cum:
        cum = (alloc((S * cfg.BT, H, K), torch.float32), alloc((S * cfg.BT, H, K), torch.float32))
    ch, cl = cum if cum is not None else (el, el)
    cap = {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}
    _cumsum_scores_kernel[(S, H)](
        q, k, g, A, qg, kg, el, ch, cl, cu_seqlens if cu_seqlens is not None else q, T, N,
        search_steps(N), H=H, K=K, BT=cfg.BT, BC=cfg.BC, BK=cfg.BK, STORE_CUM=store_cum,
        IS_VARLEN=cu_seqlens is not None, PREC=prec, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **cap)
    return cum, kg, el, A, qg
