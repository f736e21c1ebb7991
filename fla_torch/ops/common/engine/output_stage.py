"""Output stage (Triton), forward and backward, chunk-parallel, with the gate switch.

One program per (chunk slot, head, V or K block); the chunk is walked in sub-chunks of BC rows.
With S = h[slot] (state before the chunk), dS = dh[slot] (gradient of the state after it) and
b the in-chunk cumsum of the log-decay (per key channel c for the key gate):
    o_i  = scale * ((q_i * exp(b_i)) S + sum_{j <= i} A_ij v_j),
    A_ij = sum_c q_ic k_jc exp(b_ic - b_jc).
A's rows of sub-chunk I: the columns of earlier sub-chunks factor through the sub-chunk's first
row r (q_i exp(b_i - b_r), k_j exp(b_r - b_j): every exponent <= 0) into one tensor-core dot;
the diagonal sub-block is exact per pair. The backward does the same for dA = scale * do v^T
(dv: columns of sub-chunk J through its last row; dq / dk: through the row just before /
after the sub-chunk, the decay of the other side applied to the fp32 product):
    dv_j = sum_{i >= j} A_ij do_i * scale + (k_j * exp(last - b_j)) dS
    dq_i = scale exp(b_i) do_i S^T + sum_{j <= i} dA_ij exp(b_i - b_j) k_j
    dk_j = exp(last - b_j) v_j dS^T + sum_{i >= j} dA_ij exp(b_i - b_j) q_i
dg per token s and channel, per chunk (nothing carried from chunk to chunk, no O(1) term formed
and cancelled: the pair i == j is left out of both sides, and so is the chunk's last token
in the prefix of r):
    dg_s = exp(last) <S, dS>_row + sum_{j < s} r_j + sum_{i >= s} x_i,
    r_j  = k_j . (exp(last - b_j) v_j dS^T),
    x_i  = q_i . (dq_i without the pair i == i) - k_i . (the intra-chunk dk_i without it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gates import GATE_SCALAR, gap, load_gate, load_gate_row, pick_col, pick_row, split
from .launch import launch_for
from .varlen import n_slots, search_steps, slot_chunk


@triton.jit
def _load_row(x, t, i_h, eos, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    """Row [BK] (fp32) of token t of x [B*T, H, K]; 0 at t >= eos."""
    return tl.load(x + (t * H + i_h) * K + o_k, mask=m_k & (o_k * 0 + t < eos),
                   other=0.).to(tl.float32)


@triton.jit
def _sub_gates(g, hi_f, lo_f, row_I, o_t, o_k, m_I, m_k, i0, K: tl.constexpr,
               GATE: tl.constexpr, BC: tl.constexpr):
    """Split cumsum (hi, lo) [BC, GW] of sub-chunk rows i0.. of a chunk whose split cumsum is
    (hi_f, lo_f) [BT, GW], and (r_hi, r_lo) [GW]: the cumsum at row i0 - 1 (0 for i0 = 0)."""
    r_hi, r_lo = pick_row(hi_f, o_t, i0 - 1), pick_row(lo_f, o_t, i0 - 1)
    g_I = load_gate(g, row_I, o_k, m_I, m_k, K, GATE, BC)
    off = r_hi.to(tl.float64) + r_lo.to(tl.float64)
    hi_I, lo_I = split(off[None, :] + tl.cumsum(g_I, axis=0))
    return hi_I, lo_I, r_hi, r_lo


@triton.jit
def _output_fwd_kernel(q, k, v, g, h, o, cu_seqlens, scale, T, N, n_steps, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                       IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    slot, i_hv = tl.program_id(0), tl.program_id(1)
    i_h, i_vb = i_hv % H, i_hv // H
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    NC: tl.constexpr = BT // BC
    NK: tl.constexpr = (K + BK - 1) // BK
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_v = o_v < V
    t_f = c0 + o_t
    m_f = t_f < eos
    row_f = t_f * H + i_h
    p_h = h + (slot.to(tl.int64) * H + i_h) * K * V
    b_v = tl.load(v + row_f[:, None] * V + o_v[None, :], mask=m_f[:, None] & m_v[None, :],
                  other=0.)
    for I in range(NC):
        i0 = I * BC
        t_I = c0 + i0 + o_c
        m_I = t_I < eos
        row_I = t_I * H + i_h
        acc = tl.zeros([BC, BV], dtype=tl.float32)
        A = tl.zeros([BC, BT], dtype=tl.float32)
        for kb in range(NK):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            q_I = tl.load(q + row_I[:, None] * K + o_k[None, :], mask=m_I[:, None] & m_k[None, :],
                          other=0.)
            k_f = tl.load(k + row_f[:, None] * K + o_k[None, :], mask=m_f[:, None] & m_k[None, :],
                          other=0.)
            b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :],
                          mask=(m_k[:, None] & m_v[None, :]), other=0.)
            g_f = load_gate(g, row_f, o_k, m_f, m_k, K, GATE, BT)
            hi_f, lo_f = split(tl.cumsum(g_f, axis=0))
            hi_I, lo_I, r_hi, r_lo = _sub_gates(g, hi_f, lo_f, row_I, o_t, o_k, m_I, m_k, i0, K,
                                                GATE, BC)
            acc += tl.dot((q_I * tl.exp(hi_I + lo_I)).to(dt), b_h, input_precision=PREC)
            f_hi, f_lo = pick_row(hi_I, o_c, 0), pick_row(lo_I, o_c, 0)
            q_d = (q_I * tl.exp(gap(hi_I, lo_I, f_hi[None, :], f_lo[None, :]))).to(dt)
            e_k = tl.where(o_t[:, None] < i0, gap(f_hi[None, :], f_lo[None, :], hi_f, lo_f),
                           float("-inf"))
            k_d = (k_f * tl.exp(e_k)).to(dt)
            A += tl.dot(q_d, tl.trans(k_d), input_precision=PREC)
            q_32 = q_I.to(tl.float32)
            b_j = r_hi.to(tl.float64) + r_lo.to(tl.float64)
            for j in range(BC):
                t_j = c0 + i0 + j
                k_j = _load_row(k, t_j, i_h, eos, o_k, m_k, H, K)
                b_j += load_gate_row(g, t_j, i_h, eos, o_k, m_k, H, K, GATE)
                h_j, l_j = split(b_j)
                e = tl.where(o_c[:, None] >= j, gap(hi_I, lo_I, h_j[None, :], l_j[None, :]),
                             float("-inf"))
                a = tl.sum(q_32 * k_j[None, :] * tl.exp(e), axis=1)
                A += tl.where(o_t[None, :] == i0 + j, a[:, None], 0.)
        acc += tl.dot(A.to(dt), b_v, input_precision=PREC)
        tl.store(o + row_I[:, None] * V + o_v[None, :], (acc * scale).to(o.dtype.element_ty),
                 mask=m_I[:, None] & m_v[None, :])


@triton.jit
def _output_bwd_dv_kernel(q, k, g, dh, do, dv, cu_seqlens, scale, T, N, n_steps,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          GATE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    slot, i_hv = tl.program_id(0), tl.program_id(1)
    i_h, i_vb = i_hv % H, i_hv // H
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    NC: tl.constexpr = BT // BC
    NK: tl.constexpr = (K + BK - 1) // BK
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_v = o_v < V
    t_f = c0 + o_t
    m_f = t_f < eos
    row_f = t_f * H + i_h
    p_dh = dh + (slot.to(tl.int64) * H + i_h) * K * V
    b_do = tl.load(do + row_f[:, None] * V + o_v[None, :], mask=m_f[:, None] & m_v[None, :],
                   other=0.)
    for J in range(NC):
        j0 = J * BC
        t_J = c0 + j0 + o_c
        m_J = t_J < eos
        row_J = t_J * H + i_h
        acc = tl.zeros([BC, BV], dtype=tl.float32)
        At = tl.zeros([BC, BT], dtype=tl.float32)       # At[j, i] = A_ij, j in sub-chunk J
        for kb in range(NK):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            k_J = tl.load(k + row_J[:, None] * K + o_k[None, :], mask=m_J[:, None] & m_k[None, :],
                          other=0.)
            q_f = tl.load(q + row_f[:, None] * K + o_k[None, :], mask=m_f[:, None] & m_k[None, :],
                          other=0.)
            b_dh = tl.load(p_dh + o_k[:, None] * V + o_v[None, :],
                           mask=(m_k[:, None] & m_v[None, :]), other=0.)
            g_f = load_gate(g, row_f, o_k, m_f, m_k, K, GATE, BT)
            hi_f, lo_f = split(tl.cumsum(g_f, axis=0))
            l_hi, l_lo = split(tl.sum(g_f, axis=0))
            hi_J, lo_J, r_hi, r_lo = _sub_gates(g, hi_f, lo_f, row_J, o_t, o_k, m_J, m_k, j0, K,
                                                GATE, BC)
            k_e = (k_J * tl.exp(gap(l_hi[None, :], l_lo[None, :], hi_J, lo_J))).to(dt)
            acc += tl.dot(k_e, b_dh, input_precision=PREC)
            e_hi, e_lo = pick_row(hi_J, o_c, BC - 1), pick_row(lo_J, o_c, BC - 1)
            k_d = (k_J * tl.exp(gap(e_hi[None, :], e_lo[None, :], hi_J, lo_J))).to(dt)
            e_q = tl.where(o_t[:, None] > j0 + BC - 1,
                           gap(hi_f, lo_f, e_hi[None, :], e_lo[None, :]), float("-inf"))
            q_d = (q_f * tl.exp(e_q)).to(dt)
            At += tl.dot(k_d, tl.trans(q_d), input_precision=PREC)
            k_32 = k_J.to(tl.float32)
            b_i = r_hi.to(tl.float64) + r_lo.to(tl.float64)
            for i in range(BC):
                t_i = c0 + j0 + i
                q_i = _load_row(q, t_i, i_h, eos, o_k, m_k, H, K)
                b_i += load_gate_row(g, t_i, i_h, eos, o_k, m_k, H, K, GATE)
                h_i, l_i = split(b_i)
                e = tl.where(o_c[:, None] <= i, gap(h_i[None, :], l_i[None, :], hi_J, lo_J),
                             float("-inf"))
                a = tl.sum(k_32 * q_i[None, :] * tl.exp(e), axis=1)
                At += tl.where(o_t[None, :] == j0 + i, a[:, None], 0.)
        acc += tl.dot((At * scale).to(dt), b_do, input_precision=PREC)
        tl.store(dv + row_J[:, None] * V + o_v[None, :], acc.to(dv.dtype.element_ty),
                 mask=m_J[:, None] & m_v[None, :])


@triton.jit
def _output_bwd_dqk_kernel(q, k, v, g, h, dh, do, dq, dk, dg, cu_seqlens, scale, T, N, n_steps,
                           dg_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, GATE: tl.constexpr, STORE_DG: tl.constexpr,
                           IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    slot, i_hk = tl.program_id(0), tl.program_id(1)
    i_h, i_kb = i_hk % H, i_hk // H
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = q.dtype.element_ty
    NC: tl.constexpr = BT // BC
    NV: tl.constexpr = (V + BV - 1) // BV
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    t_f = c0 + o_t
    m_f = t_f < eos
    row_f = t_f * H + i_h
    t_last = tl.minimum(c0 + BT, eos) - 1
    hoff = (slot.to(tl.int64) * H + i_h) * K * V
    m_fk = m_f[:, None] & m_k[None, :]
    q_f = tl.load(q + row_f[:, None] * K + o_k[None, :], mask=m_fk, other=0.)
    k_f = tl.load(k + row_f[:, None] * K + o_k[None, :], mask=m_fk, other=0.)
    g_f = load_gate(g, row_f, o_k, m_f, m_k, K, GATE, BT)
    hi_f, lo_f = split(tl.cumsum(g_f, axis=0))
    l_hi, l_lo = split(tl.sum(g_f, axis=0))
    ct = tl.zeros([BK], dtype=tl.float32)
    if STORE_DG:
        for vb in range(NV):
            o_v = vb * BV + tl.arange(0, BV)
            m_kv = m_k[:, None] & (o_v < V)[None, :]
            b_h = tl.load(h + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
            b_dh = tl.load(dh + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
            ct += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        ct = ct * tl.exp(l_hi + l_lo)
    pre_r = tl.zeros([BK], dtype=tl.float32)
    pre_x = tl.zeros([BK], dtype=tl.float32)
    for I in range(NC):
        i0 = I * BC
        t_I = c0 + i0 + o_c
        m_I = t_I < eos
        row_I = t_I * H + i_h
        m_Ik = m_I[:, None] & m_k[None, :]
        q_I = tl.load(q + row_I[:, None] * K + o_k[None, :], mask=m_Ik, other=0.)
        k_I = tl.load(k + row_I[:, None] * K + o_k[None, :], mask=m_Ik, other=0.)
        hi_I, lo_I, r_hi, r_lo = _sub_gates(g, hi_f, lo_f, row_I, o_t, o_k, m_I, m_k, i0, K,
                                            GATE, BC)
        dA = tl.zeros([BC, BT], dtype=tl.float32)     # dA[i, j], i in sub-chunk I
        dAt = tl.zeros([BC, BT], dtype=tl.float32)    # dAt[j, i] = dA[i, j], j in I
        dq_s = tl.zeros([BC, BK], dtype=tl.float32)
        dk_s = tl.zeros([BC, BK], dtype=tl.float32)
        for vb in range(NV):
            o_v = vb * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_kv = m_k[:, None] & m_v[None, :]
            m_Iv = m_I[:, None] & m_v[None, :]
            m_fv = m_f[:, None] & m_v[None, :]
            do_I = tl.load(do + row_I[:, None] * V + o_v[None, :], mask=m_Iv, other=0.)
            v_I = tl.load(v + row_I[:, None] * V + o_v[None, :], mask=m_Iv, other=0.)
            do_f = tl.load(do + row_f[:, None] * V + o_v[None, :], mask=m_fv, other=0.)
            v_f = tl.load(v + row_f[:, None] * V + o_v[None, :], mask=m_fv, other=0.)
            b_h = tl.load(h + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
            b_dh = tl.load(dh + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
            dA += tl.dot(do_I, tl.trans(v_f), input_precision=PREC)
            dAt += tl.dot(v_I, tl.trans(do_f), input_precision=PREC)
            dq_s += tl.dot(do_I, tl.trans(b_h), input_precision=PREC)
            dk_s += tl.dot(v_I, tl.trans(b_dh), input_precision=PREC)
        dA *= scale
        dAt *= scale
        dq_s = dq_s * (scale * tl.exp(hi_I + lo_I))
        dk_s = dk_s * tl.exp(gap(l_hi[None, :], l_lo[None, :], hi_I, lo_I))
        # sub-chunks before I (dq) and after I (dk). The 16-bit operand keeps its largest
        # entries undecayed (reference: the row just before / just after I) and the rest of
        # the decay multiplies the fp32 product: fp16 would flush exp(-10) k to subnormals
        i_n1 = tl.minimum(i0 + BC, BT - 1)
        n_hi, n_lo = pick_row(hi_f, o_t, i_n1), pick_row(lo_f, o_t, i_n1)
        e_k = tl.where(o_t[:, None] < i0, gap(r_hi[None, :], r_lo[None, :], hi_f, lo_f),
                       float("-inf"))
        k_d = (k_f * tl.exp(e_k)).to(dt)
        dq_i = tl.dot(tl.where(o_t[None, :] < i0, dA, 0.).to(dt), k_d, input_precision=PREC)
        dq_i *= tl.exp(gap(hi_I, lo_I, r_hi[None, :], r_lo[None, :]))
        e_q = tl.where(o_t[:, None] > i0 + BC - 1, gap(hi_f, lo_f, n_hi[None, :], n_lo[None, :]),
                       float("-inf"))
        q_d = (q_f * tl.exp(e_q)).to(dt)
        dk_i = tl.dot(tl.where(o_t[None, :] > i0 + BC - 1, dAt, 0.).to(dt), q_d,
                      input_precision=PREC)
        dk_i *= tl.exp(gap(n_hi[None, :], n_lo[None, :], hi_I, lo_I))
        # the diagonal sub-block, exact per pair, without the pair i == j
        q_32 = q_I.to(tl.float32)
        k_32 = k_I.to(tl.float32)
        b_j = r_hi.to(tl.float64) + r_lo.to(tl.float64)
        for j in range(BC):
            t_j = c0 + i0 + j
            b_j += load_gate_row(g, t_j, i_h, eos, o_k, m_k, H, K, GATE)
            h_j, l_j = split(b_j)
            k_j = _load_row(k, t_j, i_h, eos, o_k, m_k, H, K)
            q_j = _load_row(q, t_j, i_h, eos, o_k, m_k, H, K)
            a = pick_col(dA, o_t, i0 + j)
            e = tl.where(o_c[:, None] > j, gap(hi_I, lo_I, h_j[None, :], l_j[None, :]),
                         float("-inf"))
            dq_i += a[:, None] * k_j[None, :] * tl.exp(e)
            a2 = pick_col(dAt, o_t, i0 + j)
            e2 = tl.where(o_c[:, None] < j, gap(h_j[None, :], l_j[None, :], hi_I, lo_I),
                          float("-inf"))
            dk_i += a2[:, None] * q_j[None, :] * tl.exp(e2)
        d_ii = tl.sum(tl.where(o_t[None, :] == i0 + o_c[:, None], dA, 0.), axis=1)
        b_dq = dq_s + dq_i + d_ii[:, None] * k_32
        b_dk = dk_s + dk_i + d_ii[:, None] * q_32
        tl.store(dq + row_I[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_Ik)
        tl.store(dk + row_I[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_Ik)
        if STORE_DG:
            x = q_32 * (dq_s + dq_i) - k_32 * dk_i
            r = tl.where(t_I[:, None] == t_last, 0., k_32 * dk_s)
            w = (ct[None, :] + pre_r[None, :] - pre_x[None, :]
                 + (tl.cumsum(r, axis=0) - r) - (tl.cumsum(x, axis=0) - x))
            if GATE == GATE_SCALAR:
                tl.store(dg + i_kb * dg_stride + row_I, tl.sum(w, axis=1), mask=m_I)
            else:
                tl.store(dg + row_I[:, None] * K + o_k[None, :], w, mask=m_Ik)
            pre_r += tl.sum(r, axis=0)
            pre_x += tl.sum(x, axis=0)
    if STORE_DG:
        # dg_s = w_s + (sum of x over the whole chunk): add the total now known
        tl.debug_barrier()
        for I in range(NC):
            t_I = c0 + I * BC + o_c
            m_I = t_I < eos
            row_I = t_I * H + i_h
            if GATE == GATE_SCALAR:
                p = dg + i_kb * dg_stride + row_I
                tl.store(p, tl.load(p, mask=m_I, other=0.) + tl.sum(pre_x, axis=0), mask=m_I)
            else:
                p = dg + row_I[:, None] * K + o_k[None, :]
                m_Ik = m_I[:, None] & m_k[None, :]
                tl.store(p, tl.load(p, mask=m_Ik, other=0.) + pre_x[None, :], mask=m_Ik)


def _chunk_grid_args(q, cu_seqlens, BT):
    B, T = q.shape[0], q.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = n_slots(B, T, N, BT, cu_seqlens is not None)
    return S, dict(T=T, N=N, n_steps=search_steps(N))


def output_fwd(q, k, v, g, gate: int, h, scale: float, cu_seqlens, prec: str, alloc):
    """o [B, T, H, V] in q's dtype from q, k [B, T, H, K], v [B, T, H, V], the gate and h
    [slots, H, K, V] (state before each chunk, from state_pass_fwd)."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    cfg = launch_for("output_fwd", K, V, q.dtype)
    S, a = _chunk_grid_args(q, cu_seqlens, cfg.BT)
    o = alloc(v.shape, q.dtype)
    _output_fwd_kernel[(S, H * triton.cdiv(V, cfg.BV))](
        q, k, v, g if g is not None else q, h, o, cu_seqlens if cu_seqlens is not None else q,
        scale, a["T"], a["N"], a["n_steps"], H=H, K=K, V=V, BT=cfg.BT, BC=cfg.BC, BK=cfg.BK,
        BV=cfg.BV, GATE=gate, IS_VARLEN=cu_seqlens is not None, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o


def output_bwd(q, k, v, g, gate: int, h, dh, do, scale: float, cu_seqlens, need_dg: bool,
               prec: str, alloc):
    """(dq, dk, dv in their inputs' dtypes, dg fp32 shaped like g, or None).
    h / dh [slots, H, K, V]: state before / state gradient after each chunk; in q's dtype."""
    B, T, H, K = q.shape
    V = v.shape[3]
    cfg = launch_for("output_bwd_dv", K, V, q.dtype)
    S, a = _chunk_grid_args(q, cu_seqlens, cfg.BT)
    cu = cu_seqlens if cu_seqlens is not None else q
    gg = g if g is not None else q
    dv = alloc(v.shape, v.dtype)
    _output_bwd_dv_kernel[(S, H * triton.cdiv(V, cfg.BV))](
        q, k, gg, dh, do, dv, cu, scale, a["T"], a["N"], a["n_steps"], H=H, K=K, V=V,
        BT=cfg.BT, BC=cfg.BC, BK=cfg.BK, BV=cfg.BV, GATE=gate,
        IS_VARLEN=cu_seqlens is not None, PREC=prec, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    cfg = launch_for("output_bwd_dqk", K, V, q.dtype)
    NKB = triton.cdiv(K, cfg.BK)
    dq = alloc(q.shape, q.dtype)
    dk = alloc(k.shape, k.dtype)
    store_dg = need_dg and g is not None
    dg = None
    if store_dg:
        dg = alloc((NKB, B * T * H), torch.float32) if gate == GATE_SCALAR.value else \
            alloc(g.shape, torch.float32)
    _output_bwd_dqk_kernel[(S, H * NKB)](
        q, k, v, gg, h, dh, do, dq, dk, dg if dg is not None else dq, cu, scale, a["T"],
        a["N"], a["n_steps"], B * T * H, H=H, K=K, V=V, BT=cfg.BT, BC=cfg.BC, BK=cfg.BK,
        BV=cfg.BV, GATE=gate, STORE_DG=store_dg, IS_VARLEN=cu_seqlens is not None, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if store_dg and gate == GATE_SCALAR.value:
        dg = dg.sum(0).view(g.shape)
    return dq, dk, dv, dg
