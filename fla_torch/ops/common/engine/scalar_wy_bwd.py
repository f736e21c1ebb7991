"""Backward of the WY / UT transform of one chunk (BT = 64): w = Tm (beta exp(gc) k),
u = Tm (beta v), Tm = (I + A)^-1, A = strict(beta (k k^T) * D) (see scalar_delta_bwd.py for the
formulas). One program per chunk x value head.

Cost choices (the 64x64 fp32 internals dominate):
- dTm = (dw k^T diag(exp(gc)) + du v^T) diag(beta): the column scales are applied after the
  products, so k and v enter the tensor cores in their input dtype and only the fp32 dw / du
  are split (split_dot.py); the beta / gate factors are not re-materialised per tile.
- (beta B) k + (beta B)^T k = (Bb + Bb^T) k: one product instead of two.
- Tm^T is split into bf16 hi / lo once and reused by dA, dk and dv.
- dk is written once, in its final dtype when the caller asks (value heads == q/k heads).
fp32 inputs keep one "tf32x3" dot per product (fp32-accurate).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..triton_scalar_gate import suffix_sum
from .scalar_delta_fwd import chunk_coords, decay_matrix, load_gates
from .split_dot import _bf16_pair, split_dot32, split_dot_wide


@triton.jit
def _dot_tm(a, a_hi, a_lo, b, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """a [M, K] fp32 (pre-split into bf16 a_hi + a_lo when SPLIT) times fp32 b [K, N]."""
    if SPLIT:
        b_hi, b_lo = _bf16_pair(b)
        out = tl.dot(a_hi, b_hi) + tl.dot(a_lo, b_hi) + tl.dot(a_hi, b_lo)
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def _wy_bwd2_kernel(k, v, beta, gc_buf, gc_lo, tm_buf, dk_buf, dw_buf, dvn_buf, dgc_buf, dk_out, dv,
                    dbeta, dg, offsets, N, n_steps, T, part_stride,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BT: tl.constexpr, IS_VARLEN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    HAS_G: tl.constexpr, NKB: tl.constexpr, SPLIT: tl.constexpr,
                    PREC: tl.constexpr, PREC16: tl.constexpr):
    """In: dk_buf (direct part of dk, fp32), dw_buf, dvn_buf (= du) fp32, the NKB partials of
    dg from `dqk` (per token, already summed). Out: dk_out [B*T, HV, K] (fp32 or the input
    dtype), dv (input dtype), dbeta fp32, dg fp32 (gated: the dqk shares + the suffix sums of
    this kernel's terms of dgc).
    PREC: fp32 products ("tf32x3"); PREC16: the input-dtype product k k^T (the input dtype's
    own precision: "tf32x3" on fp16 operands gave a 5e-2 dbeta error on the H100, where
    k k^T enters only dbeta / dg)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_coords(offsets, i_c, N, n_steps, T, BT, IS_VARLEN)
    if t0 >= eos:      # a slot of no chunk
        return
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    mask_t = rows < eos
    b_beta = tl.load(beta + rows * HV + i_hv, mask=mask_t, other=0.0)
    b_gc, b_lo, g_last, l_last = load_gates(gc_buf, gc_lo, rows, mask_t,
                                            tl.minimum(t0 + BT, eos) - 1, i_hv, HV, HAS_G)
    b_eg = tl.exp(b_gc)
    m_tt = mask_t[:, None] & (o_t < BT)[None, :]
    b_Tm = tl.load(tm_buf + (rows * HV + i_hv)[:, None] * BT + o_t[None, :], mask=m_tt,
                   other=0.0)
    b_TmT = tl.trans(b_Tm)
    t_hi, t_lo = _bf16_pair(b_TmT)
    b_dTk = tl.zeros([BT, BT], dtype=tl.float32)   # dw k^T
    b_dTv = tl.zeros([BT, BT], dtype=tl.float32)   # du v^T
    b_KK = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = mask_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_dw = tl.load(dw_buf + (rows * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_tk,
                       other=0.0)
        b_dTk += split_dot_wide(b_dw, tl.trans(b_k), PREC)
        b_KK += tl.dot(b_k, tl.trans(b_k), input_precision=PREC16)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = mask_t[:, None] & (o_v < V)[None, :]
        p_tv = (rows * HV + i_hv)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0)
        b_du = tl.load(dvn_buf + p_tv, mask=m_tv, other=0.0)
        b_dTv += split_dot_wide(b_du, tl.trans(b_v), PREC)
    b_dTm = (b_dTk * b_eg[None, :] + b_dTv) * b_beta[None, :]
    strict = o_t[:, None] > o_t[None, :]
    b_dA = _dot_tm(b_TmT, t_hi, t_lo, b_dTm, SPLIT, PREC)
    b_dA = -split_dot32(b_dA, b_TmT, SPLIT, PREC)
    b_B = b_dA * decay_matrix(b_gc, b_lo, b_gc, b_lo, strict)
    b_db = tl.sum(b_B * b_KK, axis=1)
    b_Bb = b_B * b_beta[:, None]
    b_Bs = b_Bb + tl.trans(b_Bb)
    b_bg = b_beta * b_eg
    b_wk = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = mask_t[:, None] & (o_k < K)[None, :]
        p_tk = (rows * HV + i_hv)[:, None] * K + o_k[None, :]
        b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_dw = tl.load(dw_buf + p_tk, mask=m_tk, other=0.0)
        b_dkb = _dot_tm(b_TmT, t_hi, t_lo, b_dw, SPLIT, PREC)
        b_dk = tl.load(dk_buf + p_tk, mask=m_tk, other=0.0)
        b_dk += b_bg[:, None] * b_dkb + split_dot_wide(b_Bs, b_k, PREC)
        b_wk += b_eg * tl.sum(b_k.to(tl.float32) * b_dkb, axis=1)
        tl.store(dk_out + p_tk, b_dk.to(dk_out.dtype.element_ty), mask=m_tk)
    b_db += b_wk
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = mask_t[:, None] & (o_v < V)[None, :]
        p_tv = (rows * HV + i_hv)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_du = tl.load(dvn_buf + p_tv, mask=m_tv, other=0.0)
        b_dvb = _dot_tm(b_TmT, t_hi, t_lo, b_du, SPLIT, PREC)
        b_db += tl.sum(b_v * b_dvb, axis=1)
        tl.store(dv + p_tv, (b_beta[:, None] * b_dvb).to(dv.dtype.element_ty), mask=m_tv)
    tl.store(dbeta + rows * HV + i_hv, b_db, mask=mask_t)
    if HAS_G:
        b_Ad = b_Bb * b_KK   # dA * A
        b_dgc = b_beta * b_wk + tl.sum(b_Ad, axis=1) - tl.sum(b_Ad, axis=0)
        b_dg = suffix_sum(b_dgc, o_t)
        p_dgc = dgc_buf + rows * HV + i_hv
        for p in range(NKB):
            b_dg += tl.load(p_dgc, mask=mask_t, other=0.0)
            p_dgc += part_stride
        tl.store(dg + rows * HV + i_hv, b_dg, mask=mask_t)
