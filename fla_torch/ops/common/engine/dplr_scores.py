"""Per-key-decay scores of a DPLR chunk (Triton), forward and backward (autograd.Function).

Inputs in the slot layout [S, H, BT, K] fp32 (dplr.py): r, k, a, b and the log-decay w
(pad rows zero). Per chunk, with G_i = w_1 + ... + w_i (fp64 cumsum inside the chunk, per key),
Gx_i = G_i - w_i and L = G at the chunk's last row:
    A_ab[i, j] = sum_c a_ic b_jc exp(Gx_ic - G_jc)    (j < i)     A_ak likewise with k_j
    A_rb[i, j] = sum_c r_ic b_jc exp(G_ic - G_jc)      (j <= i)    A_rk likewise with k_j
    r_in = r exp(G), a_in = a exp(Gx), b_out = b exp(L - G), k_out = k exp(L - G),
    tot = exp(L)                                                          [S, H, K]
Every exponent is a difference of fp64 cumsums taken before the cast to fp32, masked to -inf
outside the causal part before exp (all <= 0: no overflow at gates of -20). The pairs are
formed column by column (exact per pair, one program per chunk slot and head).

Backward: the gradients of r, k, a, b by the same pairs, and dw per chunk without carrying
anything across chunks: each pair (i, j) of exponent G_i - G_j gives its coefficient
c = dA_ij x_i y_j exp(.) to every w_s with j < s <= i, accumulated as P_i (row) and M_j
(column), dw_s = sum_{t >= s} (P_t - M_t); the zero-length pairs (i == j, and i - 1 == j for
the exclusive ones) depend on no gate and are left out, so no O(1) term is formed and
cancelled under strong gates. The boundary terms go the same way (prefix / suffix sums as
dots with triangular 0/1 matrices).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_alloc import alloc
from ..triton_scalar_gate import block, fp32_dot_precision


@triton.jit
def _row(x, o_t, j):
    """Row j of the tile x [BT, BK] -> [BK]."""
    return tl.sum(tl.where(o_t[:, None] == j, x, 0.), axis=0)


@triton.jit
def _col(x, o_t, j):
    """Column j of the tile x [BT, BT] -> [BT]."""
    return tl.sum(tl.where(o_t[None, :] == j, x, 0.), axis=1)


@triton.jit
def _cums(w, p, m):
    """fp64 (G, Gx, L) of the log-decay tile at pointers p."""
    x = tl.load(w + p, mask=m, other=0.).to(tl.float64)
    G = tl.cumsum(x, axis=0)
    return G, G - x, tl.sum(x, axis=0)


@triton.jit
def _fwd_kernel(r, k, a, b, w, Aab, Aak, Arb, Ark, rin, ain, bout, kout, tot,
                H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    base = i_s.to(tl.int64) * H + i_h
    o_t = tl.arange(0, BT)
    acc_ab = tl.zeros([BT, BT], dtype=tl.float32)
    acc_ak = tl.zeros([BT, BT], dtype=tl.float32)
    acc_rb = tl.zeros([BT, BT], dtype=tl.float32)
    acc_rk = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        p = (base * BT + o_t)[:, None] * K + o_k[None, :]
        m = (o_t[:, None] < BT) & m_k[None, :]
        b_r = tl.load(r + p, mask=m, other=0.)
        b_k = tl.load(k + p, mask=m, other=0.)
        b_a = tl.load(a + p, mask=m, other=0.)
        b_b = tl.load(b + p, mask=m, other=0.)
        G, Gx, L = _cums(w, p, m)
        e_end = tl.exp((L[None, :] - G).to(tl.float32))
        tl.store(rin + p, b_r * tl.exp(G.to(tl.float32)), mask=m)
        tl.store(ain + p, b_a * tl.exp(Gx.to(tl.float32)), mask=m)
        tl.store(bout + p, b_b * e_end, mask=m)
        tl.store(kout + p, b_k * e_end, mask=m)
        tl.store(tot + base * K + o_k, tl.exp(L.to(tl.float32)), mask=m_k)
        for j in range(BT):
            G_j = _row(G, o_t, j)
            b_j = _row(b_b, o_t, j)
            k_j = _row(b_k, o_t, j)
            ex = tl.exp(tl.where(o_t[:, None] > j, (Gx - G_j[None, :]).to(tl.float32),
                                 float("-inf")))
            ei = tl.exp(tl.where(o_t[:, None] >= j, (G - G_j[None, :]).to(tl.float32),
                                 float("-inf")))
            ae = b_a * ex
            re = b_r * ei
            sel = o_t[None, :] == j
            acc_ab += tl.where(sel, tl.sum(ae * b_j[None, :], axis=1)[:, None], 0.)
            acc_ak += tl.where(sel, tl.sum(ae * k_j[None, :], axis=1)[:, None], 0.)
            acc_rb += tl.where(sel, tl.sum(re * b_j[None, :], axis=1)[:, None], 0.)
            acc_rk += tl.where(sel, tl.sum(re * k_j[None, :], axis=1)[:, None], 0.)
    pA = (base * BT + o_t)[:, None] * BT + o_t[None, :]
    tl.store(Aab + pA, acc_ab)
    tl.store(Aak + pA, acc_ak)
    tl.store(Arb + pA, acc_rb)
    tl.store(Ark + pA, acc_rk)


@triton.jit
def _bwd_kernel(r, k, a, b, w, dAab, dAak, dArb, dArk, drin, dain, dbout, dkout, dtot,
                dr, dk, da, db, dw, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, PREC: tl.constexpr):
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    base = i_s.to(tl.int64) * H + i_h
    o_t = tl.arange(0, BT)
    pA = (base * BT + o_t)[:, None] * BT + o_t[None, :]
    g_ab = tl.load(dAab + pA)
    g_ak = tl.load(dAak + pA)
    g_rb = tl.load(dArb + pA)
    g_rk = tl.load(dArk + pA)
    up_incl = tl.where(o_t[None, :] >= o_t[:, None], 1., 0.)     # [s, t]: t >= s
    up_strict = tl.where(o_t[None, :] > o_t[:, None], 1., 0.)    # t > s
    lo_strict = tl.where(o_t[None, :] < o_t[:, None], 1., 0.)    # t < s
    for kb in range(tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        p = (base * BT + o_t)[:, None] * K + o_k[None, :]
        m = (o_t[:, None] < BT) & m_k[None, :]
        b_r = tl.load(r + p, mask=m, other=0.)
        b_k = tl.load(k + p, mask=m, other=0.)
        b_a = tl.load(a + p, mask=m, other=0.)
        b_b = tl.load(b + p, mask=m, other=0.)
        G, Gx, L = _cums(w, p, m)
        e_r = tl.exp(G.to(tl.float32))
        e_a = tl.exp(Gx.to(tl.float32))
        e_end = tl.exp((L[None, :] - G).to(tl.float32))
        g_rin = tl.load(drin + p, mask=m, other=0.)
        g_ain = tl.load(dain + p, mask=m, other=0.)
        g_bout = tl.load(dbout + p, mask=m, other=0.)
        g_kout = tl.load(dkout + p, mask=m, other=0.)
        acc_r = g_rin * e_r
        acc_a = g_ain * e_a
        acc_b = g_bout * e_end
        acc_k = g_kout * e_end
        P = acc_r * b_r                          # pair (i, chunk start)
        P_x = acc_a * b_a                        # pair (i - 1, chunk start)
        c_end = (acc_b * b_b + acc_k * b_k)      # pair (chunk end, j)
        M = tl.zeros([BT, BK], dtype=tl.float32)
        for j in range(BT):
            G_j = _row(G, o_t, j)
            b_j = _row(b_b, o_t, j)
            k_j = _row(b_k, o_t, j)
            ex = tl.exp(tl.where(o_t[:, None] > j, (Gx - G_j[None, :]).to(tl.float32),
                                 float("-inf")))
            ei = tl.exp(tl.where(o_t[:, None] >= j, (G - G_j[None, :]).to(tl.float32),
                                 float("-inf")))
            c_ab = _col(g_ab, o_t, j)[:, None]
            c_ak = _col(g_ak, o_t, j)[:, None]
            c_rb = _col(g_rb, o_t, j)[:, None]
            c_rk = _col(g_rk, o_t, j)[:, None]
            gr = (c_rb * b_j[None, :] + c_rk * k_j[None, :]) * ei
            ga = (c_ab * b_j[None, :] + c_ak * k_j[None, :]) * ex
            acc_r += gr
            acc_a += ga
            ae = b_a * ex
            re = b_r * ei
            sel = o_t[:, None] == j
            acc_b += tl.where(sel, tl.sum(c_ab * ae + c_rb * re, axis=0)[None, :], 0.)
            acc_k += tl.where(sel, tl.sum(c_ak * ae + c_rk * re, axis=0)[None, :], 0.)
            p_in = tl.where(o_t[:, None] > j, gr * b_r, 0.)
            p_ex = tl.where(o_t[:, None] > j + 1, ga * b_a, 0.)
            P += p_in
            P_x += p_ex
            M += tl.where(sel, tl.sum(p_in + p_ex, axis=0)[None, :], 0.)
        g_tot = tl.load(dtot + base * K + o_k, mask=m_k, other=0.) * tl.exp(L.to(tl.float32))
        b_dw = (tl.dot(up_incl, P - M, input_precision=PREC)
                + tl.dot(up_strict, P_x, input_precision=PREC)
                + tl.dot(lo_strict, c_end, input_precision=PREC) + g_tot[None, :])
        tl.store(dr + p, acc_r, mask=m)
        tl.store(dk + p, acc_k, mask=m)
        tl.store(da + p, acc_a, mask=m)
        tl.store(db + p, acc_b, mask=m)
        tl.store(dw + p, b_dw, mask=m)


def _bk(K):
    return min(block(K), 64)


class DplrScores(torch.autograd.Function):
    """(r, k, a, b, w) [S, H, BT, K] fp32 -> (A_ab, A_ak, A_rb, A_rk [S, H, BT, BT],
    r_in, a_in, b_out, k_out [S, H, BT, K], tot [S, H, K]), all fp32."""

    @staticmethod
    def forward(ctx, r, k, a, b, w):
        S, H, BT, K = r.shape
        dev = r.device
        mats = [alloc((S, H, BT, BT), torch.float32, dev) for _ in range(4)]
        vecs = [alloc((S, H, BT, K), torch.float32, dev) for _ in range(4)]
        tot = alloc((S, H, K), torch.float32, dev)
        _fwd_kernel[(S, H)](r, k, a, b, w, *mats, *vecs, tot, H=H, K=K, BT=BT, BK=_bk(K),
                            num_warps=4, num_stages=1)
        ctx.save_for_backward(r, k, a, b, w)
        return (*mats, *vecs, tot)

    @staticmethod
    def backward(ctx, *grads):
        r, k, a, b, w = ctx.saved_tensors
        S, H, BT, K = r.shape
        dev = r.device
        grads = [g.contiguous() for g in grads]
        outs = [alloc((S, H, BT, K), torch.float32, dev) for _ in range(5)]
        _bwd_kernel[(S, H)](r, k, a, b, w, *grads, *outs, H=H, K=K, BT=BT, BK=_bk(K),
                            PREC=fp32_dot_precision(), num_warps=4, num_stages=1)
        dr, dk, da, db, dw = outs
        return dr, dk, da, db, dw
