"""WY / UT forward of one chunk (BT = 64): gc, Tm = (I + A)^-1, w, u.

A[s, r] = beta_s (k_s . k_r) exp(gc_s - gc_r) (r < s; gc = fp64 cumsum kept as fp32 hi + lo,
see load_gates in scalar_delta_fwd.py) is handled as its 10 lower 16x16 blocks
A_ij (i >= j, rows of block i, columns of block j), straight from 16-row tiles of k (faster
on an H100, by 0.2 ms, than one 64-row k k^T parked in tm_buf and re-read as blocks). The
inverse T = (I + A)^-1 is block lower triangular:
    T_ii = (I + A_ii)^-1                         forward substitution on 16 rows, registers
    T_ij = -T_ii sum_{j <= m < i} A_im T_mj      (i > j), 16x16 fp32 products
so no 64-step substitution over a 64x64 tile is needed. Tm is stored (fp32, zero above the
diagonal; kept for the backward); after a barrier the program re-reads it as one 64x64 tile
and, with cs = beta exp(gc),
    w = (Tm diag(cs)) k,    u = (Tm diag(beta)) v         (64-row products)
(w is stored relative to the chunk's first token: cs = beta exp(gc - gc_first), see below)
(the fp32 factor is split in hi + lo of the input dtype: two exact 16-bit products; see
split_dot.py). Within a program, a store, `tl.debug_barrier()` (bar.sync) and a load
see each other's data; the reloads read with ".cg" (L2).
One program per chunk x value head; time is the flattened B*T axis (see scalar_delta_fwd.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .scalar_delta_fwd import chunk_coords
from .split_dot import split_dot


@triton.jit
def _gap(c_i, l_i, c_j, l_j):
    """gc_i[:, None] - gc_j[None, :] from the hi + lo split of the cumsum."""
    return (c_i[:, None] - c_j[None, :]) + (l_i[:, None] - l_j[None, :])


@triton.jit
def _diag_block(a, beta_i, c_i, l_i, HAS_G: tl.constexpr):
    """Strictly lower part of a diagonal block of A, scaled by beta and the decays."""
    o = tl.arange(0, 16)
    strict = o[:, None] > o[None, :]
    a = a * beta_i[:, None]
    if HAS_G:
        a = a * tl.exp(tl.where(strict, _gap(c_i, l_i, c_i, l_i), 0.0))
    return tl.where(strict, a, 0.0)


@triton.jit
def _off_block(a, beta_i, c_i, l_i, c_j, l_j, HAS_G: tl.constexpr):
    """Block of A below the diagonal (rows of block i > columns of block j)."""
    a = a * beta_i[:, None]
    if HAS_G:
        a = a * tl.exp(_gap(c_i, l_i, c_j, l_j))
    return a


@triton.jit
def _subst_row(a, t, sel, e):
    """Row i of (I + a)^-1 from its rows < i (forward substitution step)."""
    a_r = tl.sum(tl.where(sel, a, 0.0), axis=0)
    row = e - tl.sum(a_r[:, None] * t, axis=0)
    return tl.where(sel, row[None, :], t)


@triton.jit
def _cumsum_split(g, gc_buf, gc_lo, rows, mask, i_hv, HV: tl.constexpr, start):
    """fp64 cumsum of 16 gates after `start` (fp64); stores and returns it split as fp32
    hi + lo (see load_gates in scalar_delta_fwd.py), and the fp64 running total."""
    x = tl.load(g + rows * HV + i_hv, mask=mask, other=0.0).to(tl.float64)
    c = tl.cumsum(x, axis=0) + start
    hi = c.to(tl.float32)
    lo = (c - hi.to(tl.float64)).to(tl.float32)
    tl.store(gc_buf + rows * HV + i_hv, hi, mask=mask)
    tl.store(gc_lo + rows * HV + i_hv, lo, mask=mask)
    return hi, lo, start + tl.sum(x, axis=0)


@triton.jit
def _store16(tm_buf, rows, mask, i_hv, col0: tl.constexpr, blk, HV: tl.constexpr,
             BT: tl.constexpr):
    o = tl.arange(0, 16)
    tl.store(tm_buf + (rows * HV + i_hv)[:, None] * BT + col0 + o[None, :], blk,
             mask=mask[:, None] & (o < 16)[None, :])


@triton.jit
def _load_rows(x, rows, mask, i_head, NH: tl.constexpr, D: tl.constexpr, o_d, mask_d):
    return tl.load(x + (rows * NH + i_head)[:, None] * D + o_d[None, :],
                   mask=mask[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def _store_rows(x, val, rows, mask, i_head, NH: tl.constexpr, D: tl.constexpr, o_d, mask_d):
    tl.store(x + (rows * NH + i_head)[:, None] * D + o_d[None, :],
             val.to(x.dtype.element_ty), mask=mask[:, None] & mask_d[None, :])


@triton.jit
def _wy_fwd16_kernel(k, v, g, beta, gc_buf, gc_lo, tm_buf, w_buf, u_buf, offsets, N, n_steps, T,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, IS_VARLEN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_G: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr):
    """gc_buf, gc_lo [B*T, HV] fp32 (gated: chunk-local cumsum, hi + lo), tm_buf [B*T, HV, BT] fp32, w_buf [B*T, HV, K] (input
    dtype), u_buf [B*T, HV, V] (input dtype). PREC: dots on the input dtype (k k^T); PREC32:
    the fp32 16x16 block products of the inverse."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_coords(offsets, i_c, N, n_steps, T, BT, IS_VARLEN)
    if t0 >= eos:      # a slot of no chunk
        return
    o16 = tl.arange(0, 16)
    r0 = t0 + o16
    r1 = r0 + 16
    r2 = r0 + 32
    r3 = r0 + 48
    m0 = r0 < eos
    m1 = r1 < eos
    m2 = r2 < eos
    m3 = r3 < eos
    b0 = tl.load(beta + r0 * HV + i_hv, mask=m0, other=0.0)
    b1 = tl.load(beta + r1 * HV + i_hv, mask=m1, other=0.0)
    b2 = tl.load(beta + r2 * HV + i_hv, mask=m2, other=0.0)
    b3 = tl.load(beta + r3 * HV + i_hv, mask=m3, other=0.0)
    if HAS_G:
        # chunk-local cumsum in fp64, kept as fp32 hi + lo; padded rows (g = 0) carry the
        # last valid value
        s = tl.zeros([1], dtype=tl.float64)
        s = tl.sum(s, axis=0)
        c0, l0, s = _cumsum_split(g, gc_buf, gc_lo, r0, m0, i_hv, HV, s)
        c1, l1, s = _cumsum_split(g, gc_buf, gc_lo, r1, m1, i_hv, HV, s)
        c2, l2, s = _cumsum_split(g, gc_buf, gc_lo, r2, m2, i_hv, HV, s)
        c3, l3, s = _cumsum_split(g, gc_buf, gc_lo, r3, m3, i_hv, HV, s)
    else:
        c0 = tl.zeros([16], dtype=tl.float32)
        c1 = c0
        c2 = c0
        c3 = c0
        l0 = c0
        l1 = c0
        l2 = c0
        l3 = c0
    z = tl.zeros([16, 16], dtype=tl.float32)
    a00 = z
    a10 = z
    a11 = z
    a20 = z
    a21 = z
    a22 = z
    a30 = z
    a31 = z
    a32 = z
    a33 = z
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mk = o_k < K
        k0 = _load_rows(k, r0, m0, i_h, H, K, o_k, mk)
        k1 = _load_rows(k, r1, m1, i_h, H, K, o_k, mk)
        k2 = _load_rows(k, r2, m2, i_h, H, K, o_k, mk)
        k3 = _load_rows(k, r3, m3, i_h, H, K, o_k, mk)
        a00 += tl.dot(k0, tl.trans(k0), input_precision=PREC)
        a10 += tl.dot(k1, tl.trans(k0), input_precision=PREC)
        a11 += tl.dot(k1, tl.trans(k1), input_precision=PREC)
        a20 += tl.dot(k2, tl.trans(k0), input_precision=PREC)
        a21 += tl.dot(k2, tl.trans(k1), input_precision=PREC)
        a22 += tl.dot(k2, tl.trans(k2), input_precision=PREC)
        a30 += tl.dot(k3, tl.trans(k0), input_precision=PREC)
        a31 += tl.dot(k3, tl.trans(k1), input_precision=PREC)
        a32 += tl.dot(k3, tl.trans(k2), input_precision=PREC)
        a33 += tl.dot(k3, tl.trans(k3), input_precision=PREC)
    a00 = _diag_block(a00, b0, c0, l0, HAS_G)
    a11 = _diag_block(a11, b1, c1, l1, HAS_G)
    a22 = _diag_block(a22, b2, c2, l2, HAS_G)
    a33 = _diag_block(a33, b3, c3, l3, HAS_G)
    a10 = _off_block(a10, b1, c1, l1, c0, l0, HAS_G)
    a20 = _off_block(a20, b2, c2, l2, c0, l0, HAS_G)
    a21 = _off_block(a21, b2, c2, l2, c1, l1, HAS_G)
    a30 = _off_block(a30, b3, c3, l3, c0, l0, HAS_G)
    a31 = _off_block(a31, b3, c3, l3, c1, l1, HAS_G)
    a32 = _off_block(a32, b3, c3, l3, c2, l2, HAS_G)
    # diagonal blocks of the inverse: 16 substitution steps, the four blocks side by side
    t00 = z
    t11 = z
    t22 = z
    t33 = z
    for i in range(0, 16):
        sel = o16[:, None] == i
        e = tl.where(o16 == i, 1.0, 0.0)
        t00 = _subst_row(a00, t00, sel, e)
        t11 = _subst_row(a11, t11, sel, e)
        t22 = _subst_row(a22, t22, sel, e)
        t33 = _subst_row(a33, t33, sel, e)
    # blocks below the diagonal: T_ij = -T_ii sum_{j <= m < i} A_im T_mj
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision=PREC32), input_precision=PREC32)
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision=PREC32), input_precision=PREC32)
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision=PREC32), input_precision=PREC32)
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=PREC32)
                  + tl.dot(a21, t10, input_precision=PREC32), input_precision=PREC32)
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=PREC32)
                  + tl.dot(a32, t21, input_precision=PREC32), input_precision=PREC32)
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=PREC32)
                  + tl.dot(a31, t10, input_precision=PREC32)
                  + tl.dot(a32, t20, input_precision=PREC32), input_precision=PREC32)
    _store16(tm_buf, r0, m0, i_hv, 0, t00, HV, BT)
    _store16(tm_buf, r0, m0, i_hv, 16, z, HV, BT)
    _store16(tm_buf, r0, m0, i_hv, 32, z, HV, BT)
    _store16(tm_buf, r0, m0, i_hv, 48, z, HV, BT)
    _store16(tm_buf, r1, m1, i_hv, 0, t10, HV, BT)
    _store16(tm_buf, r1, m1, i_hv, 16, t11, HV, BT)
    _store16(tm_buf, r1, m1, i_hv, 32, z, HV, BT)
    _store16(tm_buf, r1, m1, i_hv, 48, z, HV, BT)
    _store16(tm_buf, r2, m2, i_hv, 0, t20, HV, BT)
    _store16(tm_buf, r2, m2, i_hv, 16, t21, HV, BT)
    _store16(tm_buf, r2, m2, i_hv, 32, t22, HV, BT)
    _store16(tm_buf, r2, m2, i_hv, 48, z, HV, BT)
    _store16(tm_buf, r3, m3, i_hv, 0, t30, HV, BT)
    _store16(tm_buf, r3, m3, i_hv, 16, t31, HV, BT)
    _store16(tm_buf, r3, m3, i_hv, 32, t32, HV, BT)
    _store16(tm_buf, r3, m3, i_hv, 48, t33, HV, BT)
    # w and u as 64-row products: the CTA re-reads the Tm it just stored (the barrier makes
    # the stores of every thread visible; ".cg" reads from L2, past the SM's L1)
    tl.debug_barrier()
    rows = t0 + tl.arange(0, BT)
    m_t = rows < eos
    o_c = tl.arange(0, BT)
    tm = tl.load(tm_buf + (rows * HV + i_hv)[:, None] * BT + o_c[None, :],
                 mask=m_t[:, None], other=0.0, cache_modifier=".cg")
    b = tl.load(beta + rows * HV + i_hv, mask=m_t, other=0.0)
    # u = T diag(beta) v
    tb = tm * b[None, :]
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        b_v = _load_rows(v, rows, m_t, i_hv, HV, V, o_v, mv)
        _store_rows(u_buf, split_dot(tb, b_v, PREC), rows, m_t, i_hv, HV, V, o_v, mv)
    # w = T diag(beta exp(gc - gc_first)) k: relative to the chunk's first token, whose factor
    # exp(gc_first) = exp(g_first) the users of w apply in fp32 (`first_gate`): under strong
    # gates exp(gc) alone flushes fp16 w to zero (dh0 lost all accuracy: 1.0 interpreted)
    if HAS_G:
        gcr = tl.load(gc_buf + rows * HV + i_hv, mask=m_t, other=0.0, cache_modifier=".cg")
        gclo = tl.load(gc_lo + rows * HV + i_hv, mask=m_t, other=0.0, cache_modifier=".cg")
        g0 = tl.load(gc_buf + t0 * HV + i_hv, cache_modifier=".cg")
        l0 = tl.load(gc_lo + t0 * HV + i_hv, cache_modifier=".cg")
        b = b * tl.exp(tl.where(m_t, (gcr - g0) + (gclo - l0), 0.0))
    ts = tm * b[None, :]
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mk = o_k < K
        b_k = _load_rows(k, rows, m_t, i_h, H, K, o_k, mk)
        _store_rows(w_buf, split_dot(ts, b_k, PREC), rows, m_t, i_hv, HV, K, o_k, mk)
