"""Backward of the DPLR scores (dplr_scores.py) as three Triton kernels: row side, column side
(one program per chunk, head and 16-row sub-chunk each), then dw per chunk and key block.

With the notation of dplr_scores.py (x in {r, a shifted up} the row vectors, y in {b, k} the
column vectors, pairs (i, j), j <= i, through exp(G_i - G_j); G the forward's fp64 in-chunk
cumsum, kept in gbuf):
 1. _dplr_scores_bwd_row (per slot, head, sub-chunk): the gradients of the row vectors
    g_x[i] = sum_{j < i} dA_ij y_j exp(G_i - G_j) (earlier sub-chunks through a reference row,
    the diagonal sub-block by one dot under gates.SPAN or per pair) plus the boundary terms and
    the gate-free pairs i == j -> dr, da; and P_i = sum_x x_i (g_x + b_x) (pm);
 2. _dplr_scores_bwd_col (per slot, head, sub-chunk): g_y[j] = sum_{i > j} dA_ij x_i
    exp(G_i - G_j) likewise -> db, dk (with the chunk-end terms), and pm <- P_j - M_j with
    M_j = sum_y y_j g_y;
 3. _dplr_scores_bwd_dw (per slot, head, key block): dw_s = sum_{t >= s} (P_t - M_t) plus the
    chunk-end and total-decay terms (prefix / suffix sums by tl.cumsum).
No O(1) term is formed and cancelled: the pairs i == j depend on no gate and stay out of dw.
The dots with other sub-chunks take bf16 operands for a bf16 op (dA and the decayed vectors
rounded, as KDA's delta_bwd does), fp32-accurate ones otherwise; the diagonal blocks are
fp32-accurate always.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_alloc import alloc
from ..triton_scalar_gate import block, fp32_dot_precision
from .dplr_scores import (BC, BT, _diag, _diag_span, _dot, _ex, _ld, _ldA, _ldx, _ldx_row, _st,
                          _stx, _sub_rows, _tk, dot_dtype)

# key block and warps of the row and column kernels, and the dw kernel's key block (a tuning
# script may override entries). H100 bf16 RWKV-7 B4 T4096 H16 K64, fwd+bwd minus fwd (session 9
# call 1): 64 / 4 warps 4.17 ms, 32 / 4 5.01, 16 / 2 5.37, 64 / 8 5.44, 16 / 4 7.47, 32 / 8
# 7.69; the per-chunk kernels before: 4.84 (32 / 4) in the same call. maxnreg (None: the
# compiler's choice) per kernel, call 5 (bf16 dots with other sub-chunks) at 64 / 4: row 168
# (None +0.15 ms fwd+bwd, 128 +0.14), col 168 -0.11 (128 +0.09); BK 32 +0.70, 8 warps +1.42.
# dw kernel: key block 16 (call 7: -0.05 ms against 32; 64 +0.06).
LAUNCH = dict(BK=64, num_warps=4, BK_dw=16, maxnreg_row=168, maxnreg_col=168)


@triton.jit
def _diag_dA(dArb, dArk, dAab, dAak, base, rows, m_r, m_a, BT: tl.constexpr):
    """The sub-chunk's diagonal [BC, BC] blocks of dA_rb, dA_rk and (rows shifted by one)
    dA_ab, dA_ak."""
    return (_ldA(dArb, base, rows, m_r, rows, m_r, BT), _ldA(dArk, base, rows, m_r, rows, m_r, BT),
            _ldA(dAab, base, rows + 1, m_a, rows, m_r, BT),
            _ldA(dAak, base, rows + 1, m_a, rows, m_r, BT))


@triton.jit
def _dplr_scores_bwd_row(r, k, a, b, tok, gbuf, pm, dAab, dAak, dArb, dArk, drin, dain, dr, da,
                         H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                         BK: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    i_s, i_h, I = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    base = i_s * H + i_h
    o_c = tl.arange(0, BC)
    strict = o_c[:, None] > o_c[None, :]
    i0 = I * BC
    rows, m_r, m_a, t_I, t_Ia = _sub_rows(tok, i_s, i0, BT, BC)
    q_rb, q_rk, q_ab, q_ak = _diag_dA(dArb, dArk, dAab, dAak, base, rows, m_r, m_a, BT)
    t_0 = tl.load(tok + i_s * BT)
    for kb in range(tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        if I == 0:
            # row 0 of da: a_0 enters a_in only, with exp(0)
            tl.store(da + (t_0 * H + i_h) * K + o_k,
                     tl.load(dain + (base * BT) * K + o_k, mask=m_k, other=0.).to(
                         da.dtype.element_ty), mask=m_k & (o_k * 0 + t_0 >= 0))
        G_I = _ld(gbuf, base, rows, m_r, o_k, m_k, K, BT)
        g_r = tl.zeros([BC, BK], dtype=tl.float32)
        g_a = tl.zeros([BC, BK], dtype=tl.float32)
        if I > 0:
            # earlier sub-chunks J, one 16-row block at a time, through row i0 (exponents <= 0)
            G_f = tl.load(gbuf + (base * BT + i0) * K + o_k, mask=m_k, other=0.)
            for J in range(0, I):
                cols, m_c, _, t_J, _ = _sub_rows(tok, i_s, J * BC, BT, BC)
                e_c = _ex(G_f[None, :] - _ld(gbuf, base, cols, m_c, o_k, m_k, K, BT))
                c_b = _ldx(b, t_J, i_h, o_k, m_k, H, K) * e_c
                c_k = _ldx(k, t_J, i_h, o_k, m_k, H, K) * e_c
                g_r += (_dot(_ldA(dArb, base, rows, m_r, cols, m_c, BT), c_b, DT, PREC)
                        + _dot(_ldA(dArk, base, rows, m_r, cols, m_c, BT), c_k, DT, PREC))
                g_a += (_dot(_ldA(dAab, base, rows + 1, m_a, cols, m_c, BT), c_b, DT, PREC)
                        + _dot(_ldA(dAak, base, rows + 1, m_a, cols, m_c, BT), c_k, DT, PREC))
            e_r = _ex(G_I - G_f[None, :])
            g_r *= e_r
            g_a *= e_r
        y_b = _ldx(b, t_I, i_h, o_k, m_k, H, K)
        y_k = _ldx(k, t_I, i_h, o_k, m_k, H, K)
        fits, e_f = _diag_span(gbuf, base, i0, G_I, o_k, m_k, K, BT, BC)
        if fits:
            f_in = _ex(e_f)
            yb_f = y_b * _ex(-e_f)
            yk_f = y_k * _ex(-e_f)
            g_r += f_in * (tl.dot(tl.where(strict, q_rb, 0.), yb_f, input_precision="tf32x3")
                           + tl.dot(tl.where(strict, q_rk, 0.), yk_f, input_precision="tf32x3"))
            g_a += f_in * (tl.dot(tl.where(strict, q_ab, 0.), yb_f, input_precision="tf32x3")
                           + tl.dot(tl.where(strict, q_ak, 0.), yk_f, input_precision="tf32x3"))
        else:
            for j in range(BC):
                G_j = tl.load(gbuf + (base * BT + i0 + j) * K + o_k, mask=m_k, other=0.)
                e = _ex(tl.where(o_c[:, None] > j, G_I - G_j[None, :], float("-inf")))
                yb_j = _ldx_row(b, tok, i_s, i0 + j, i_h, o_k, m_k, H, K, BT)[None, :]
                yk_j = _ldx_row(k, tok, i_s, i0 + j, i_h, o_k, m_k, H, K, BT)[None, :]
                at_j = o_c[None, :] == j
                c_rb = tl.sum(tl.where(at_j, q_rb, 0.), axis=1)[:, None]
                c_rk = tl.sum(tl.where(at_j, q_rk, 0.), axis=1)[:, None]
                c_ab = tl.sum(tl.where(at_j, q_ab, 0.), axis=1)[:, None]
                c_ak = tl.sum(tl.where(at_j, q_ak, 0.), axis=1)[:, None]
                g_r += e * (c_rb * yb_j + c_rk * yk_j)
                g_a += e * (c_ab * yb_j + c_ak * yk_j)
        # boundary terms (pairs with the chunk's start), P, the gate-free pairs i == j
        e_s = _ex(G_I)
        g_r += _ld(drin, base, rows, m_r, o_k, m_k, K, BT) * e_s
        g_a += _ld(dain, base, rows + 1, m_a, o_k, m_k, K, BT) * e_s
        x_r = _ldx(r, t_I, i_h, o_k, m_k, H, K)
        x_a = _ldx(a, t_Ia, i_h, o_k, m_k, H, K)
        _st(pm, x_r * g_r + x_a * g_a, base, rows, m_r, o_k, m_k, K, BT)
        _stx(dr, g_r + _diag(q_rb, o_c)[:, None] * y_b + _diag(q_rk, o_c)[:, None] * y_k,
             t_I, i_h, o_k, m_k, H, K)
        _stx(da, g_a + _diag(q_ab, o_c)[:, None] * y_b + _diag(q_ak, o_c)[:, None] * y_k,
             t_Ia, i_h, o_k, m_k, H, K)


@triton.jit
def _dplr_scores_bwd_col(r, k, a, b, tok, gbuf, pm, dAab, dAak, dArb, dArk, dbout, dkout, db,
                         dk, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                         DT: tl.constexpr):
    i_s, i_h, I = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    base = i_s * H + i_h
    o_c = tl.arange(0, BC)
    strict = o_c[:, None] > o_c[None, :]
    i0 = I * BC
    rows, m_r, m_a, t_I, t_Ia = _sub_rows(tok, i_s, i0, BT, BC)
    q_rb, q_rk, q_ab, q_ak = _diag_dA(dArb, dArk, dAab, dAak, base, rows, m_r, m_a, BT)
    for kb in range(tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        L = tl.load(gbuf + (base * BT + BT - 1) * K + o_k, mask=m_k, other=0.)
        G_I = _ld(gbuf, base, rows, m_r, o_k, m_k, K, BT)
        g_b = tl.zeros([BC, BK], dtype=tl.float32)
        g_k = tl.zeros([BC, BK], dtype=tl.float32)
        if i0 + BC < BT:
            # later sub-chunks J, one 16-row block at a time, through row i0 + BC - 1
            G_l = tl.load(gbuf + (base * BT + i0 + BC - 1) * K + o_k, mask=m_k, other=0.)
            for J in range(I + 1, BT // BC):
                cols, m_c, m_cs, t_J, t_Js = _sub_rows(tok, i_s, J * BC, BT, BC)
                e_w = _ex(_ld(gbuf, base, cols, m_c, o_k, m_k, K, BT) - G_l[None, :])
                w_r = _ldx(r, t_J, i_h, o_k, m_k, H, K) * e_w
                w_a = _ldx(a, t_Js, i_h, o_k, m_k, H, K) * e_w
                g_b += (_dot(tl.trans(_ldA(dArb, base, cols, m_c, rows, m_r, BT)), w_r, DT,
                             PREC)
                        + _dot(tl.trans(_ldA(dAab, base, cols + 1, m_cs, rows, m_r, BT)), w_a,
                               DT, PREC))
                g_k += (_dot(tl.trans(_ldA(dArk, base, cols, m_c, rows, m_r, BT)), w_r, DT,
                             PREC)
                        + _dot(tl.trans(_ldA(dAak, base, cols + 1, m_cs, rows, m_r, BT)), w_a,
                               DT, PREC))
            e_l = _ex(G_l[None, :] - G_I)
            g_b *= e_l
            g_k *= e_l
        x_r = _ldx(r, t_I, i_h, o_k, m_k, H, K)
        x_a = _ldx(a, t_Ia, i_h, o_k, m_k, H, K)
        fits, e_f = _diag_span(gbuf, base, i0, G_I, o_k, m_k, K, BT, BC)
        if fits:
            f_out = _ex(-e_f)
            xr_f = x_r * _ex(e_f)
            xa_f = x_a * _ex(e_f)
            g_b += f_out * (tl.dot(tl.trans(tl.where(strict, q_rb, 0.)), xr_f,
                                   input_precision="tf32x3")
                            + tl.dot(tl.trans(tl.where(strict, q_ab, 0.)), xa_f,
                                     input_precision="tf32x3"))
            g_k += f_out * (tl.dot(tl.trans(tl.where(strict, q_rk, 0.)), xr_f,
                                   input_precision="tf32x3")
                            + tl.dot(tl.trans(tl.where(strict, q_ak, 0.)), xa_f,
                                     input_precision="tf32x3"))
        else:
            for j in range(BC):
                G_j = tl.load(gbuf + (base * BT + i0 + j) * K + o_k, mask=m_k, other=0.)
                e = _ex(tl.where(o_c[:, None] > j, G_I - G_j[None, :], float("-inf")))
                at_j = o_c[None, :] == j
                c_rb = tl.sum(tl.where(at_j, q_rb, 0.), axis=1)[:, None]
                c_rk = tl.sum(tl.where(at_j, q_rk, 0.), axis=1)[:, None]
                c_ab = tl.sum(tl.where(at_j, q_ab, 0.), axis=1)[:, None]
                c_ak = tl.sum(tl.where(at_j, q_ak, 0.), axis=1)[:, None]
                row_b = tl.sum(e * (c_rb * x_r + c_ab * x_a), axis=0)
                row_k = tl.sum(e * (c_rk * x_r + c_ak * x_a), axis=0)
                g_b += tl.where(o_c[:, None] == j, row_b[None, :], 0.)
                g_k += tl.where(o_c[:, None] == j, row_k[None, :], 0.)
        y_b = _ldx(b, t_I, i_h, o_k, m_k, H, K)
        y_k = _ldx(k, t_I, i_h, o_k, m_k, H, K)
        P = _ld(pm, base, rows, m_r, o_k, m_k, K, BT)
        _st(pm, P - (y_b * g_b + y_k * g_k), base, rows, m_r, o_k, m_k, K, BT)
        e_e = _ex(L[None, :] - G_I)
        _stx(db, g_b + _diag(q_rb, o_c)[:, None] * x_r + _diag(q_ab, o_c)[:, None] * x_a
             + _ld(dbout, base, rows, m_r, o_k, m_k, K, BT) * e_e, t_I, i_h, o_k, m_k, H, K)
        _stx(dk, g_k + _diag(q_rk, o_c)[:, None] * x_r + _diag(q_ak, o_c)[:, None] * x_a
             + _ld(dkout, base, rows, m_r, o_k, m_k, K, BT) * e_e, t_I, i_h, o_k, m_k, H, K)


@triton.jit
def _dplr_scores_bwd_dw(b, k, tok, gbuf, pm, dbout, dkout, dtot, dw, H: tl.constexpr,
                        K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """dw_s = sum_{t >= s} (P_t - M_t) + sum_{t < s} c_end_t + g_tot, the middle sum as the
    prefix sum of c_end shifted down one row (no inclusive sum minus its own term)."""
    i_s, i_h, kb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    base = i_s * H + i_h
    o_t = tl.arange(0, BT)
    m_t = o_t < BT
    t_all = _tk(tok, i_s, o_t, m_t, BT)
    o_k = kb * BK + tl.arange(0, BK)
    m_k = o_k < K
    L = tl.load(gbuf + (base * BT + BT - 1) * K + o_k, mask=m_k, other=0.)
    m_p = o_t >= 1
    t_p = _tk(tok, i_s, o_t - 1, m_p, BT)
    c_prev = (_ldx(b, t_p, i_h, o_k, m_k, H, K) * _ld(dbout, base, o_t - 1, m_p, o_k, m_k, K, BT)
              + _ldx(k, t_p, i_h, o_k, m_k, H, K)
              * _ld(dkout, base, o_t - 1, m_p, o_k, m_k, K, BT)) * _ex(
                  L[None, :] - _ld(gbuf, base, o_t - 1, m_p, o_k, m_k, K, BT))
    g_tot = tl.load(dtot + base * K + o_k, mask=m_k, other=0.) * _ex(L)
    b_dw = (tl.cumsum(_ld(pm, base, o_t, m_t, o_k, m_k, K, BT), axis=0, reverse=True)
            + tl.cumsum(c_prev, axis=0) + g_tot[None, :])
    _stx(dw, b_dw, t_all, i_h, o_k, m_k, H, K)


def scores_bwd(r, k, a, b, w, tok, gbuf, grads):
    """gbuf: the forward's fp64 in-chunk cumsum [S, H, BT, K] (dplr_scores.scores_fwd); grads:
    the gradients of scores_fwd's nine outputs (A_ab, A_ak, A_rb, A_rk, r_in, a_in, b_out,
    k_out, tot; slot layout, fp32, contiguous). Returns (dr, dk, da, db, dw) in the token
    layout, each in its input's dtype."""
    dAab, dAak, dArb, dArk, drin, dain, dbout, dkout, dtot = grads
    H, K = r.shape[2], r.shape[3]
    S = tok.shape[0] // BT
    dev = r.device
    dr, dk, da, db, dw = (alloc(x.shape, x.dtype, dev) for x in (r, k, a, b, w))
    pm = alloc((S, H, BT, K), torch.float32, dev)
    BK = min(block(K), LAUNCH["BK"])
    grid = (S, H, BT // BC)
    kw = dict(H=H, K=K, BT=BT, BC=BC, BK=BK, PREC=fp32_dot_precision(), DT=dot_dtype(r.dtype),
              num_warps=LAUNCH["num_warps"], num_stages=1)
    _dplr_scores_bwd_row[grid](r, k, a, b, tok, gbuf, pm, dAab, dAak, dArb, dArk, drin, dain,
                               dr, da, maxnreg=LAUNCH["maxnreg_row"], **kw)
    _dplr_scores_bwd_col[grid](r, k, a, b, tok, gbuf, pm, dAab, dAak, dArb, dArk, dbout, dkout,
                               db, dk, maxnreg=LAUNCH["maxnreg_col"], **kw)
    BKW = min(block(K), LAUNCH["BK_dw"])
    _dplr_scores_bwd_dw[(S, H, triton.cdiv(K, BKW))](b, k, tok, gbuf, pm, dbout, dkout, dtot,
                                                     dw, H=H, K=K, BT=BT, BK=BKW, num_warps=4)
    return dr, dk, da, db, dw
