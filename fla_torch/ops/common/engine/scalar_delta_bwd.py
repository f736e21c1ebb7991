"""Backward Triton kernels of the chunked (gated) delta rule (see scalar_delta_fwd.py).

Per chunk, with do the output gradient and dh_next the gradient of the chunk's end state:
    dvn     = scale (causal(q k^T) * D)^T do + (exp(gc_L - gc) k) dh_next     (D: decays)
    dh      = exp(gc_L) dh_next + scale (exp(gc) q)^T do - w^T dvn          (sequential)
    dq      = scale (exp(gc) (do h^T) + (causal(do vn^T) * D) k)
    dk      = scale (causal(do vn^T) * D)^T q + exp(gc_L - gc) (vn dh_next^T)  + WY part
    dw      = -dvn h^T,   du = dvn
  WY part (kb = beta exp(gc) k, vb = beta v, A strictly lower):
    dTm = dw kb^T + du vb^T;  dA = -(Tm^T dTm Tm^T) on the strict lower triangle; B = dA * D
    dk += beta exp(gc) Tm^T dw + (beta B) k + (beta B)^T k;   dv = beta Tm^T du
    dbeta = rowsum(B * k k^T) + exp(gc) k . (Tm^T dw) + v . (Tm^T du)
Gate: dgc = gradient w.r.t. the chunk-local cumsum gc, from every place gc enters (each term
scales with the decay it differentiates, so dg stays accurate under strong gates; the global
identity dg_t = sum_{s >= t} (q.dq - v.dv) cancelled O(1) terms: bf16 dg 0.72 at g = -20):
    dgc = q.dq_inter - k.dk_state + rowsum(M) - colsum(M)      (M = scale P * q k^T, strict)
        + beta exp(gc) (k . Tm^T dw) + rowsum(dA * A) - colsum(dA * A)
        + [last token] exp(gc_L) <h, dh_next> + sum_s k_s . dk_state_s
    dg  = reverse cumsum of dgc inside the chunk.
  The k.dk_state pair is summed in closed form, dg_t gets sum_{s < t} k_s . dk_state_s (all
  terms decayed by at least exp(g_t)) instead of -sum_{s >= t} + sum_all, whose O(1) term
  k_L . dk_state_L cancels; the reverse cumsums are masked sums (`suffix_sum`). With both
  cancellations, per-token gates in [-20, -10] gave an fp32 dg error of ~1e-3.
  `dqk` writes its K block's share of dg (already summed per token); `wy_bwd` adds its own.
Kernels: `dvn_local` (chunk-parallel), `chunk_dh` (sequential, reverse), `dqk` (per K block
x chunk); `wy_bwd` (per chunk) is in scalar_wy_bwd.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..triton_scalar_gate import prefix_sum_excl, suffix_sum
from .varlen import chunk_slot
from .scalar_delta_fwd import chunk_coords, decay_matrix, decay_to_end, first_gate, load_gates


@triton.jit
def _dvn_local_kernel(q, k, do, gc_buf, gc_lo, dvn_buf, offsets, N, n_steps, T, scale,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, IS_VARLEN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_G: tl.constexpr, PREC: tl.constexpr):
    """dvn_local[s] = scale sum_{t >= s} exp(gc_t - gc_s) (q_t . k_s) do_t  (fp32)."""
    i_v, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_coords(offsets, i_c, N, n_steps, T, BT, IS_VARLEN)
    if t0 >= eos:      # a slot of no chunk
        return
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    mask_t = rows < eos
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = mask_t[:, None] & (o_v < V)[None, :]
    b_A = tl.zeros([BT, BT], dtype=tl.float32)  # [s, t] = k_s . q_t
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = mask_t[:, None] & (o_k < K)[None, :]
        b_q = tl.load(q + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_A += tl.dot(b_k, tl.trans(b_q), input_precision=PREC)
    anti = o_t[:, None] <= o_t[None, :]
    if HAS_G:
        b_gc, b_lo, g_last, l_last = load_gates(gc_buf, gc_lo, rows, mask_t,
                                                tl.minimum(t0 + BT, eos) - 1, i_hv, HV, HAS_G)
        b_A = b_A * decay_matrix(-b_gc, -b_lo, -b_gc, -b_lo, anti)  # exp(gc_t - gc_s), s <= t
    else:
        b_A = tl.where(anti, b_A, 0.0)
    b_do = tl.load(do + (rows * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_dvn = tl.dot(b_A.to(b_do.dtype), b_do, input_precision=PREC) * scale
    tl.store(dvn_buf + (rows * HV + i_hv)[:, None] * V + o_v[None, :], b_dvn, mask=m_tv)


@triton.jit
def _chunk_dh_kernel(q, k, w_buf, do, gc_buf, gc_lo, dvn_buf, dht, dh0, dh_buf, offsets, T,
                     scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr,
                     HAS_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                     PREC: tl.constexpr):
    """Reverse over chunks: dh_buf[c] = gradient of the state at the END of chunk c (operand
    dtype); dvn_buf (in: local part, out: total dvn, fp32); dh0 (fp32)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(offsets + i_n).to(tl.int64)
    eos = tl.load(offsets + i_n + 1).to(tl.int64)
    c0 = chunk_slot(i_n, bos, 0, T, BT, IS_VARLEN)
    nc = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    DT = q.dtype.element_ty
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dh += tl.load(dht + (i_n * HV + i_hv).to(tl.int64) * K * V + p_kv, mask=mask_kv,
                        other=0.0)
    for r in range(0, nc):
        i = nc - 1 - r
        t0 = bos + i * BT
        rows = t0 + o_t
        mask_t = rows < eos
        t_last = tl.minimum(t0 + BT, eos) - 1
        tl.store(dh_buf + ((c0 + i) * HV + i_hv) * K * V + p_kv,
                 b_dh.to(dh_buf.dtype.element_ty), mask=mask_kv)
        m_tk = mask_t[:, None] & mask_k[None, :]
        m_tv = mask_t[:, None] & mask_v[None, :]
        b_q = tl.load(q + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_w = tl.load(w_buf + (rows * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_tk,
                      other=0.0)
        b_do = tl.load(do + (rows * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_tv,
                       other=0.0)
        p_dvn = dvn_buf + (rows * HV + i_hv)[:, None] * V + o_v[None, :]
        b_dvn = tl.load(p_dvn, mask=m_tv, other=0.0)
        if HAS_G:
            b_gc, b_lo, g_last, l_last = load_gates(gc_buf, gc_lo, rows, mask_t, t_last, i_hv,
                                                    HV, HAS_G)
            b_kd = b_k.to(tl.float32) * decay_to_end(b_gc, b_lo, g_last, l_last, mask_t)[:, None]
            # q exp(gc - gc_first) in the operand dtype, exp(gc_first) in fp32 (w carries the
            # same factor): under strong gates exp(gc) q flushes to zero in fp16
            g0 = first_gate(gc_buf, t0, i_hv, HV, HAS_G)
            l0 = first_gate(gc_lo, t0, i_hv, HV, HAS_G)
            b_qd = b_q.to(tl.float32) * tl.exp(tl.where(mask_t, (b_gc - g0) + (b_lo - l0), 0.0))[:, None]
            b_qd = b_qd.to(DT)
            b_dvn += tl.dot(b_kd.to(DT), b_dh.to(DT), input_precision=PREC)
            b_dh = b_dh * tl.exp(g_last)
            e0 = tl.exp(g0)
        else:
            b_qd = b_q
            b_dvn += tl.dot(b_k, b_dh.to(DT), input_precision=PREC)
            e0 = 1.0
        tl.store(p_dvn, b_dvn, mask=m_tv)
        b_dh += e0 * (scale * tl.dot(tl.trans(b_qd), b_do, input_precision=PREC)
                      - tl.dot(tl.trans(b_w.to(DT)), b_dvn.to(DT), input_precision=PREC))
    if STORE_DH0:
        tl.store(dh0 + (i_n * HV + i_hv).to(tl.int64) * K * V + p_kv, b_dh, mask=mask_kv)


@triton.jit
def _dqk_kernel(q, k, do, vn_buf, dvn_buf, h_buf, dh_buf, gc_buf, gc_lo, dq_buf, dk_buf, dw_buf,
                dgc_buf, offsets, N, n_steps, T, scale, part_stride,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, IS_VARLEN: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr,
                PREC: tl.constexpr):
    """Per K block x chunk x value head: dq (final, per value head; fp32 or the input dtype),
    dk (direct part, fp32), dw (fp32),
    and (gated) this K block's share dgc_buf[i_kb] of dg (see the module docstring):
    suffix sums of q.dq_inter + rowsum(M) - colsum(M) (M = scale P * (q k^T), strictly lower),
    + sum_{s < t} k_s.dk_state_s + exp(gc_L) <h, dh'>."""
    i_kb, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_coords(offsets, i_c, N, n_steps, T, BT, IS_VARLEN)
    if t0 >= eos:      # a slot of no chunk
        return
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    mask_t = rows < eos
    t_last = tl.minimum(t0 + BT, eos) - 1
    o_k = i_kb * BK + tl.arange(0, BK)
    mask_k = o_k < K
    m_tk = mask_t[:, None] & mask_k[None, :]
    DT = q.dtype.element_ty
    p_state = (i_c.to(tl.int64) * HV + i_hv) * K * V
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_P = tl.zeros([BT, BT], dtype=tl.float32)   # [t, s] = do_t . vn_s
    b_hdh = 0.0
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mask_v = o_v < V
        m_tv = mask_t[:, None] & mask_v[None, :]
        m_kv = mask_k[:, None] & mask_v[None, :]
        p_tv = (rows * HV + i_hv)[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        b_vn = tl.load(vn_buf + p_tv, mask=m_tv, other=0.0).to(DT)
        b_dvn = tl.load(dvn_buf + p_tv, mask=m_tv, other=0.0).to(DT)
        b_h = tl.load(h_buf + p_state + o_k[:, None] * V + o_v[None, :], mask=m_kv,
                      other=0.0).to(DT)
        b_dh = tl.load(dh_buf + p_state + o_k[:, None] * V + o_v[None, :], mask=m_kv,
                       other=0.0).to(DT)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dk += tl.dot(b_vn, tl.trans(b_dh), input_precision=PREC)
        b_dw += tl.dot(b_dvn, tl.trans(b_h), input_precision=PREC)
        b_P += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        if HAS_G:
            b_hdh += tl.sum(tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1), axis=0)
    causal = o_t[:, None] >= o_t[None, :]
    if HAS_G:
        b_gc, b_lo, g_last, l_last = load_gates(gc_buf, gc_lo, rows, mask_t, t_last, i_hv, HV,
                                                HAS_G)
        b_P = b_P * decay_matrix(b_gc, b_lo, b_gc, b_lo, causal)
        b_dq = b_dq * tl.exp(b_gc)[:, None]
        b_dk = b_dk * decay_to_end(b_gc, b_lo, g_last, l_last, mask_t)[:, None]
    else:
        b_P = tl.where(causal, b_P, 0.0)
    b_q = tl.load(q + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    if HAS_G:
        # every term scales with the decay it differentiates (no O(1) cancellation); the
        # diagonal of M cancels exactly, so it is left out
        b_q32 = b_q.to(tl.float32)
        b_k32 = b_k.to(tl.float32)
        strict = o_t[:, None] > o_t[None, :]
        b_M = tl.where(strict, b_P * tl.dot(b_q, tl.trans(b_k), input_precision=PREC), 0.0)
        b_kdk = tl.sum(b_k32 * b_dk, axis=1)
        b_x = scale * (tl.sum(b_q32 * b_dq, axis=1) + tl.sum(b_M, axis=1) - tl.sum(b_M, axis=0))
        b_dgc = suffix_sum(b_x, o_t) + prefix_sum_excl(b_kdk, o_t) + tl.exp(g_last) * b_hdh
        tl.store(dgc_buf + i_kb.to(tl.int64) * part_stride + rows * HV + i_hv, b_dgc, mask=mask_t)
    b_dq = (b_dq + tl.dot(b_P.to(DT), b_k, input_precision=PREC)) * scale
    b_dk += scale * tl.dot(tl.trans(b_P).to(DT), b_q, input_precision=PREC)
    p_tk = (rows * HV + i_hv)[:, None] * K + o_k[None, :]
    tl.store(dq_buf + p_tk, b_dq.to(dq_buf.dtype.element_ty), mask=m_tk)
    tl.store(dk_buf + p_tk, b_dk, mask=m_tk)
    tl.store(dw_buf + p_tk, -b_dw, mask=m_tk)
