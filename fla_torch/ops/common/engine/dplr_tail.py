"""The chunk-parallel part of the DPLR backward between the state pass and the scores (Triton).

Slot layout (dplr.py), fp32. Inputs per chunk and head: T = (I - A_ab)^-1 and A_ak [BT, BT],
the WY terms u [BT, V], w [BT, K] (u = T A_ak v, w = T a_in), U = u + w S_in [BT, V], S_in
[K, V], v [BT, V], k_out [BT, K]; from the state pass backward du (the gradient of u and U)
[BT, V] and dh (the gradient of the state after the chunk) [K, V]; from the output backward
dv_o [BT, V]. One program per (slot, head) forms
    dw = du S_in^T,  db_out = U dh^T,  dk_out = v dh^T,  dtot = rowsum(S_in * dh)
    dR_u = T^T du,  dR_w = T^T dw,  da_in = dR_w,
    dA_ab = strict_lower(dR_u u^T + dR_w w^T),  dA_ak = dR_u v^T,
    dv = dv_o + k_out dh + A_ak^T dR_u      (written to the token layout in v's dtype)
by fp32-accurate dots (tf32x3 unless allow_tf32(); for a bf16 op the dots with its bf16
intermediates u, w, U, S_in, k_out, v take bf16 operands), in three phases with small live sets:
the products with dh; dR_w and dR_u (stored over du) with dA_ab; dA_ak and dv.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_alloc import alloc
from ..triton_scalar_gate import block, fp32_dot_precision
from .dplr_scores import _dot, _ldx, dot_dtype


@triton.jit
def _rows(x, rows, o_d, m_d, D: tl.constexpr):
    """Tile [BT, BD] of x [S, H, BT, D] at flat rows `rows`."""
    return tl.load(x + rows[:, None] * D + o_d[None, :], mask=m_d[None, :], other=0.)


@triton.jit
def _kv(x, base, o_k, m_k, o_v, m_v, K: tl.constexpr, V: tl.constexpr):
    """Tile [BK, BV] of x [S, H, K, V] (program base `base`)."""
    return tl.load(x + (base * K + o_k)[:, None] * V + o_v[None, :],
                   mask=m_k[:, None] & m_v[None, :], other=0.)


@triton.jit
def _dplr_tail_bwd(Tm, Aak, u, w, U, S_in, v, kout, du, dh, dvo, tok, dAab, dAak, dain, dbout,
                 dkout, dtot, dv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                 DT: tl.constexpr):
    i_s, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = i_s * H + i_h
    o_t = tl.arange(0, BT)
    rows = base * BT + o_t
    p_a = rows[:, None] * BT + o_t[None, :]
    t = tl.load(tok + i_s * BT + o_t)
    # the state pass's products with dh
    for kb in range(tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        g_b = tl.zeros([BT, BK], dtype=tl.float32)
        g_k = tl.zeros([BT, BK], dtype=tl.float32)
        g_t = tl.zeros([BK], dtype=tl.float32)
        for vb in range(tl.cdiv(V, BV)):
            o_v = vb * BV + tl.arange(0, BV)
            m_v = o_v < V
            b_dh = _kv(dh, base, o_k, m_k, o_v, m_v, K, V)
            g_b += _dot(_rows(U, rows, o_v, m_v, V), tl.trans(b_dh), DT, PREC)
            g_k += _dot(_ldx(v, t, i_h, o_v, m_v, H, V), tl.trans(b_dh), DT, PREC)
            g_t += tl.sum(_kv(S_in, base, o_k, m_k, o_v, m_v, K, V).to(tl.float32) * b_dh,
                          axis=1)
        tl.store(dbout + rows[:, None] * K + o_k[None, :], g_b, mask=m_k[None, :])
        tl.store(dkout + rows[:, None] * K + o_k[None, :], g_k, mask=m_k[None, :])
        tl.store(dtot + base * K + o_k, g_t, mask=m_k)
    # the WY backward through T: dR_w, then dR_u (stored over du, which nothing reads after)
    tT = tl.trans(tl.load(Tm + p_a))
    g_ab = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        g_w = tl.zeros([BT, BK], dtype=tl.float32)
        for vb in range(tl.cdiv(V, BV)):
            o_v = vb * BV + tl.arange(0, BV)
            m_v = o_v < V
            g_w += _dot(_rows(du, rows, o_v, m_v, V),
                        tl.trans(_kv(S_in, base, o_k, m_k, o_v, m_v, K, V)), DT, PREC)
        dR_w = tl.dot(tT, g_w, input_precision=PREC)
        tl.store(dain + rows[:, None] * K + o_k[None, :], dR_w, mask=m_k[None, :])
        g_ab += _dot(dR_w, tl.trans(_rows(w, rows, o_k, m_k, K)), DT, PREC)
    for vb in range(tl.cdiv(V, BV)):
        o_v = vb * BV + tl.arange(0, BV)
        m_v = o_v < V
        dR_u = tl.dot(tT, _rows(du, rows, o_v, m_v, V), input_precision=PREC)
        g_ab += _dot(dR_u, tl.trans(_rows(u, rows, o_v, m_v, V)), DT, PREC)
        tl.store(du + rows[:, None] * V + o_v[None, :], dR_u, mask=m_v[None, :])
    tl.store(dAab + p_a, tl.where(o_t[:, None] > o_t[None, :], g_ab, 0.))
    tl.debug_barrier()
    # dA_ak and dv
    tA_ak = tl.trans(tl.load(Aak + p_a))
    g_ak = tl.zeros([BT, BT], dtype=tl.float32)
    for vb in range(tl.cdiv(V, BV)):
        o_v = vb * BV + tl.arange(0, BV)
        m_v = o_v < V
        dR_u = tl.load(du + rows[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.,
                       cache_modifier=".cg")
        g_ak += _dot(dR_u, tl.trans(_ldx(v, t, i_h, o_v, m_v, H, V)), DT, PREC)
        b_dv = _rows(dvo, rows, o_v, m_v, V) + tl.dot(tA_ak, dR_u, input_precision=PREC)
        for kb in range(tl.cdiv(K, BK)):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_dv += _dot(_rows(kout, rows, o_k, m_k, K), _kv(dh, base, o_k, m_k, o_v, m_v, K, V),
                         DT, PREC)
        tl.store(dv + (t * H + i_h)[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty),
                 mask=(t >= 0)[:, None] & m_v[None, :])
    tl.store(dAak + p_a, g_ak)


# H100 bf16 RWKV-7 K64 (session 9 call 3): 8 -> 4 warps -0.34 ms fwd+bwd (maxnreg 128: +0.31)
LAUNCH = dict(num_warps=4)


def tail_bwd(Tm, A_ak, u, w, U, S_in, v, kout, du, dh, dv_o, tok):
    """Slot layout (u, w, U, S_in, kout in dplr_scores.inter_dtype, the rest fp32) except v
    [B, T, H, V] (token layout); du is overwritten (with T^T du).
    Returns (dA_ab, dA_ak [S, H, BT, BT], da_in, db_out, dk_out [S, H, BT, K], dtot [S, H, K],
    fp32, and dv: the total gradient of v [B, T, H, V] in v's dtype)."""
    S, H, BT, K = w.shape
    V = v.shape[-1]
    dev = v.device
    dA_ab = alloc((S, H, BT, BT), torch.float32, dev)
    dA_ak = alloc((S, H, BT, BT), torch.float32, dev)
    vecs = [alloc((S, H, BT, K), torch.float32, dev) for _ in range(3)]
    dtot = alloc((S, H, K), torch.float32, dev)
    dv = alloc(v.shape, v.dtype, dev)
    _dplr_tail_bwd[(S, H)](Tm, A_ak, u, w, U, S_in, v, kout, du, dh, dv_o, tok, dA_ab, dA_ak,
                         *vecs, dtot, dv, H=H, K=K, V=V, BT=BT, BK=min(block(K), 64),
                         BV=min(block(V), 64), PREC=fp32_dot_precision(),
                         DT=dot_dtype(w.dtype), num_warps=LAUNCH["num_warps"], num_stages=1)
    return (dA_ab, dA_ak, *vecs, dtot, dv)
