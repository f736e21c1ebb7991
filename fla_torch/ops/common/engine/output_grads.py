"""Backward of the output stage (Triton), chunk-parallel, with the gate switch: three kernels
(dv and dA; the intra-chunk dq / dk; the state terms, dq, dk, dg), reading the forward's
scores A (output_stage.py) and split cumsum b (gates.chunk_cumsum), `last` b at the chunk's
end; h[slot] = S, dh[slot] = dS. With dA = scale * do v^T (causal, stored once per chunk like A):
    dv_j = scale * sum_{i >= j} A_ij do_i + (k_j * exp(last - b_j)) dS
    dq_i = scale exp(b_i) do_i S^T + sum_{j <= i} dA_ij exp(b_i - b_j) k_j
    dk_j = exp(last - b_j) v_j dS^T + sum_{i >= j} dA_ij exp(b_i - b_j) q_i
The intra-chunk sums of dq / dk run per sub-chunk of BC rows: the other sub-chunks through the
row just before / after it (the 16-bit operand keeps its largest entries undecayed, the rest of
the decay multiplies the fp32 product: fp16 would flush exp(-10) k to subnormals), the diagonal
sub-block through its first row when the decay across it is under gates.SPAN (one fp32-accurate
dot each), else exact per pair; the pair i == j left out (it is added as dA_ii k_i / dA_ii q_i).
dg per token s and channel, per chunk (nothing carried from chunk to chunk, no O(1) term formed
and cancelled):
    dg_s = exp(last) <S, dS>_row + sum_{j < s} r_j + sum_{i >= s} x_i,
    r_j  = k_j . (exp(last - b_j) v_j dS^T)          (0 for the chunk's last token),
    x_i  = q_i . (dq_i without the pair i == i) - k_i . (the intra-chunk dk_i without it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gates import GATE_SCALAR, SPAN, gap, load_cum, load_cum_row
from .launch import launch_for
from .output_stage import _cum_args, _grid_args
from .scores import _load_row
from .varlen import cdiv, slot_chunk


@triton.jit
def _output_fwd_kernel(qg, v, h, A, o, cu_seqlens, scale, T, N, n_steps, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    slot, i_hv = tl.program_id(0), tl.program_id(1)
    i_h, i_vb = i_hv % H, i_hv // H
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = qg.dtype.element_ty
    NK: tl.constexpr = (K + BK - 1) // BK
    o_t = tl.arange(0, BT)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_v = o_v < V
    t_f = c0 + o_t
    m_f = t_f < eos
    s_f = slot.to(tl.int64) * BT + o_t
    p_h = h + (slot.to(tl.int64) * H + i_h) * K * V
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for kb in range(NK):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(qg + (t_f[:, None] * H + i_h) * K + o_k[None, :],
                      mask=m_f[:, None] & m_k[None, :], other=0.)
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                      other=0.)
        acc += tl.dot(b_q, b_h, input_precision=PREC)
    b_A = tl.load(A + (s_f[:, None] * H + i_h) * BT + o_t[None, :])
    b_v = tl.load(v + (t_f[:, None] * H + i_h) * V + o_v[None, :],
                  mask=m_f[:, None] & m_v[None, :], other=0.)
    acc += tl.dot(b_A.to(dt), b_v, input_precision=PREC)
    tl.store(o + (t_f[:, None] * H + i_h) * V + o_v[None, :], (acc * scale).to(o.dtype.element_ty),
             mask=m_f[:, None] & m_v[None, :])


@triton.jit
def _bwd_dv_kernel(kg, v, A, dh, do, dv, dA, cu_seqlens, scale, T, N, n_steps, H: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    slot, i_h = tl.program_id(0), tl.program_id(1)
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = kg.dtype.element_ty
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    o_t = tl.arange(0, BT)
    t_f = c0 + o_t
    m_f = t_f < eos
    base = slot.to(tl.int64) * BT
    s_f = base + o_t
    p_dh = dh + (slot.to(tl.int64) * H + i_h) * K * V
    p_A = (s_f[:, None] * H + i_h) * BT + o_t[None, :]
    b_At = tl.trans(tl.load(A + p_A).to(dt))
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for vb in range(NV):
        o_v = vb * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_fv = m_f[:, None] & m_v[None, :]
        b_do = tl.load(do + (t_f[:, None] * H + i_h) * V + o_v[None, :], mask=m_fv, other=0.)
        b_v = tl.load(v + (t_f[:, None] * H + i_h) * V + o_v[None, :], mask=m_fv, other=0.)
        b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        acc = tl.dot(b_At, b_do, input_precision=PREC) * scale
        for kb in range(NK):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            k_e = tl.load(kg + (t_f[:, None] * H + i_h) * K + o_k[None, :],
                          mask=m_f[:, None] & m_k[None, :], other=0.)
            b_dh = tl.load(p_dh + o_k[:, None] * V + o_v[None, :],
                           mask=m_k[:, None] & m_v[None, :], other=0.)
            acc += tl.dot(k_e, b_dh, input_precision=PREC)
        tl.store(dv + (t_f[:, None] * H + i_h) * V + o_v[None, :], acc.to(dv.dtype.element_ty),
                 mask=m_fv)
    tl.store(dA + p_A, tl.where(o_t[:, None] >= o_t[None, :], b_dA * scale, 0.))


@triton.jit
def _bwd_intra_kernel(q, k, ch, cl, dA, dqi, dki, cu_seqlens, T, N, n_steps, H: tl.constexpr,
                      K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                      GATE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    slot, i_hk = tl.program_id(0), tl.program_id(1)
    i_h, i_kb = i_hk % H, i_hk // H
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    NC: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    t_f = c0 + o_t
    m_f = t_f < eos
    base = slot.to(tl.int64) * BT
    s_f = base + o_t
    m_fk = m_f[:, None] & m_k[None, :]
    q_f = tl.load(q + (t_f[:, None] * H + i_h) * K + o_k[None, :], mask=m_fk, other=0.)
    k_f = tl.load(k + (t_f[:, None] * H + i_h) * K + o_k[None, :], mask=m_fk, other=0.)
    hi_f, lo_f = load_cum(ch, cl, s_f, i_h, o_k, m_k, H, K, GATE, BT)
    for I in range(NC):
        i0 = I * BC
        t_I = c0 + i0 + o_c
        m_I = t_I < eos
        s_I = base + i0 + o_c
        hi_I, lo_I = load_cum(ch, cl, s_I, i_h, o_k, m_k, H, K, GATE, BC)
        # rows I of dA, and dA's columns I as rows (dAt[c, i] = dA[i, i0 + c])
        dA_I = tl.load(dA + (s_I[:, None] * H + i_h) * BT + o_t[None, :])
        dAt_I = tl.load(dA + (s_f[None, :] * H + i_h) * BT + i0 + o_c[:, None])
        r_hi, r_lo = load_cum_row(ch, cl, base + tl.maximum(i0 - 1, 0), i_h, o_k, m_k, H, K,
                                  GATE)
        n_hi, n_lo = load_cum_row(ch, cl, base + tl.minimum(i0 + BC, BT - 1), i_h, o_k, m_k,
                                  H, K, GATE)
        e_k = tl.where(o_t[:, None] < i0, gap(r_hi[None, :], r_lo[None, :], hi_f, lo_f),
                       float("-inf"))
        k_d = (k_f * tl.exp(e_k)).to(dt)
        dq_i = tl.dot(tl.where(o_t[None, :] < i0, dA_I, 0.).to(dt), k_d, input_precision=PREC)
        dq_i *= tl.exp(gap(hi_I, lo_I, r_hi[None, :], r_lo[None, :]))
        e_q = tl.where(o_t[:, None] > i0 + BC - 1, gap(hi_f, lo_f, n_hi[None, :], n_lo[None, :]),
                       float("-inf"))
        q_d = (q_f * tl.exp(e_q)).to(dt)
        dk_i = tl.dot(tl.where(o_t[None, :] > i0 + BC - 1, dAt_I, 0.).to(dt), q_d,
                      input_precision=PREC)
        dk_i *= tl.exp(gap(n_hi[None, :], n_lo[None, :], hi_I, lo_I))
        d_hi, d_lo = load_cum_row(ch, cl, base + i0, i_h, o_k, m_k, H, K, GATE)
        e_f = gap(hi_I, lo_I, d_hi[None, :], d_lo[None, :])     # <= 0
        if tl.max(-e_f) < SPAN:
            # the diagonal sub-block through its first row f (gates.SPAN)
            m_Ik = m_I[:, None] & m_k[None, :]
            p_Ik = (t_I[:, None] * H + i_h) * K + o_k[None, :]
            k_I = tl.load(k + p_Ik, mask=m_Ik, other=0.).to(tl.float32)
            q_I = tl.load(q + p_Ik, mask=m_Ik, other=0.).to(tl.float32)
            dA_d = tl.load(dA + (s_I[:, None] * H + i_h) * BT + i0 + o_c[None, :])
            dA_d = tl.where(o_c[:, None] > o_c[None, :], dA_d, 0.)
            ef = tl.exp(e_f)
            dq_i += ef * tl.dot(dA_d, k_I / ef, input_precision="tf32x3")
            dk_i += tl.dot(tl.trans(dA_d), q_I * ef, input_precision="tf32x3") / ef
        else:
            for j in range(BC):
                t_j = c0 + i0 + j
                h_j, l_j = load_cum_row(ch, cl, base + i0 + j, i_h, o_k, m_k, H, K, GATE)
                k_j = _load_row(k, t_j, i_h, eos, o_k, m_k, H, K)
                q_j = _load_row(q, t_j, i_h, eos, o_k, m_k, H, K)
                a = tl.load(dA + (s_I * H + i_h) * BT + i0 + j)
                e = tl.where(o_c[:, None] > j, gap(hi_I, lo_I, h_j[None, :], l_j[None, :]),
                             float("-inf"))
                dq_i += a[:, None] * k_j[None, :] * tl.exp(e)
                a2 = tl.load(dA + ((base + i0 + j) * H + i_h) * BT + i0 + o_c)
                e2 = tl.where(o_c[:, None] < j, gap(h_j[None, :], l_j[None, :], hi_I, lo_I),
                              float("-inf"))
                dk_i += a2[:, None] * q_j[None, :] * tl.exp(e2)
        p_I = (s_I[:, None] * H + i_h) * K + o_k[None, :]
        tl.store(dqi + p_I, dq_i, mask=m_k[None, :])
        tl.store(dki + p_I, dk_i, mask=m_k[None, :])


@triton.jit
def _bwd_inter_kernel(q, k, v, ch, cl, h, dh, do, dA, dqi, dki, dq, dk, dg, cu_seqlens, scale, T,
                      N, n_steps, dg_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                      STORE_DG: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    slot, i_hk = tl.program_id(0), tl.program_id(1)
    i_h, i_kb = i_hk % H, i_hk // H
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    NV: tl.constexpr = (V + BV - 1) // BV
    o_t = tl.arange(0, BT)
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    t_f = c0 + o_t
    m_f = t_f < eos
    base = slot.to(tl.int64) * BT
    s_f = base + o_t
    t_last = tl.minimum(c0 + BT, eos) - 1
    hoff = (slot.to(tl.int64) * H + i_h) * K * V
    dq_s = tl.zeros([BT, BK], dtype=tl.float32)
    dk_s = tl.zeros([BT, BK], dtype=tl.float32)
    ct = tl.zeros([BK], dtype=tl.float32)
    for vb in range(NV):
        o_v = vb * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        m_fv = m_f[:, None] & m_v[None, :]
        b_do = tl.load(do + (t_f[:, None] * H + i_h) * V + o_v[None, :], mask=m_fv, other=0.)
        b_v = tl.load(v + (t_f[:, None] * H + i_h) * V + o_v[None, :], mask=m_fv, other=0.)
        b_h = tl.load(h + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dh + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        dq_s += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        dk_s += tl.dot(b_v, tl.trans(b_dh), input_precision=PREC)
        if STORE_DG:
            ct += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    hi, lo = load_cum(ch, cl, s_f, i_h, o_k, m_k, H, K, GATE, BT)
    l_hi, l_lo = load_cum_row(ch, cl, base + BT - 1, i_h, o_k, m_k, H, K, GATE)
    dq_s = dq_s * (scale * tl.exp(hi + lo))
    dk_s = dk_s * tl.exp(gap(l_hi[None, :], l_lo[None, :], hi, lo))
    m_fk = m_f[:, None] & m_k[None, :]
    p_i = (s_f[:, None] * H + i_h) * K + o_k[None, :]
    dq_i = tl.load(dqi + p_i, mask=m_k[None, :], other=0.)
    dk_i = tl.load(dki + p_i, mask=m_k[None, :], other=0.)
    d_ii = tl.load(dA + (s_f * H + i_h) * BT + o_t)
    q_32 = tl.load(q + (t_f[:, None] * H + i_h) * K + o_k[None, :], mask=m_fk,
                   other=0.).to(tl.float32)
    k_32 = tl.load(k + (t_f[:, None] * H + i_h) * K + o_k[None, :], mask=m_fk,
                   other=0.).to(tl.float32)
    b_dq = dq_s + dq_i + d_ii[:, None] * k_32
    b_dk = dk_s + dk_i + d_ii[:, None] * q_32
    p_o = (t_f[:, None] * H + i_h) * K + o_k[None, :]
    tl.store(dq + p_o, b_dq.to(dq.dtype.element_ty), mask=m_fk)
    tl.store(dk + p_o, b_dk.to(dk.dtype.element_ty), mask=m_fk)
    if STORE_DG:
        ct = ct * tl.exp(l_hi + l_lo)
        x = q_32 * (dq_s + dq_i) - k_32 * dk_i
        r = tl.where(t_f[:, None] == t_last, 0., k_32 * dk_s)
        w = (ct[None, :] + (tl.cumsum(r, axis=0) - r) - (tl.cumsum(x, axis=0) - x)
             + tl.sum(x, axis=0)[None, :])
        if GATE == GATE_SCALAR:
            tl.store(dg + i_kb * dg_stride + t_f * H + i_h, tl.sum(w, axis=1), mask=m_f)
        else:
            tl.store(dg + p_o, w, mask=m_fk)


def output_bwd(q, k, v, kg, cum, gate: int, A, h, dh, do, scale: float, cu_seqlens,
               need_dg: bool, prec: str, alloc):
    """(dq, dk, dv in their inputs' dtypes, dg fp32 [B, T, H(, K)] or None).
    kg = k exp(last - b) and cum = the split cumsum (gates.chunk_cumsum), A as in output_fwd;
    h / dh [slots, H, K, V]: state before / state gradient after each chunk, in q's dtype."""
    B, T, H, K = q.shape
    V = v.shape[3]
    cu = cu_seqlens if cu_seqlens is not None else q
    ch, cl = _cum_args(cum, q)
    varlen = cu_seqlens is not None
    cfg = launch_for("output_bwd_dv", K, V, q.dtype)
    S, a = _grid_args(q, cu_seqlens, cfg.BT)
    dv = alloc(v.shape, v.dtype)
    dA = alloc((S * cfg.BT, H, cfg.BT), torch.float32)
    _bwd_dv_kernel[(S, H)](
        kg, v, A, dh, do, dv, dA, cu, scale, a["T"], a["N"], a["n_steps"], H=H, K=K, V=V,
        BT=cfg.BT, BK=cfg.BK, BV=cfg.BV, IS_VARLEN=varlen, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    cfg = launch_for("output_bwd_intra", K, V, q.dtype)
    dqi = alloc((S * cfg.BT, H, K), torch.float32)
    dki = alloc((S * cfg.BT, H, K), torch.float32)
    _bwd_intra_kernel[(S, H * cdiv(K, cfg.BK))](
        q, k, ch, cl, dA, dqi, dki, cu, a["T"], a["N"], a["n_steps"], H=H, K=K, BT=cfg.BT,
        BC=cfg.BC, BK=cfg.BK, GATE=gate, IS_VARLEN=varlen, PREC=prec, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    cfg = launch_for("output_bwd_inter", K, V, q.dtype)
    NKB = cdiv(K, cfg.BK)
    dq = alloc(q.shape, q.dtype)
    dk = alloc(k.shape, k.dtype)
    store_dg = need_dg and cum is not None
    dg = None
    if store_dg:
        dg = alloc((NKB, B * T * H), torch.float32) if gate == GATE_SCALAR.value else \
            alloc(q.shape, torch.float32)
    _bwd_inter_kernel[(S, H * NKB)](
        q, k, v, ch, cl, h, dh, do, dA, dqi, dki, dq, dk, dg if dg is not None else dq, cu,
        scale, a["T"], a["N"], a["n_steps"], B * T * H, H=H, K=K, V=V, BT=cfg.BT, BK=cfg.BK,
        BV=cfg.BV, GATE=gate, STORE_DG=store_dg, IS_VARLEN=varlen, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if store_dg and gate == GATE_SCALAR.value:
        dg = dg.sum(0).view(B, T, H)
    return dq, dk, dv, dg
