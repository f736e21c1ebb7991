"""The output of a DPLR chunk (Triton, chunk-parallel), forward and backward.

Slot layout (dplr.py): r_in [S, H, BT, K], S_in [S, H, K, V], U [S, H, BT, V], A_rb, A_rk
[S, H, BT, BT] in dplr_scores.inter_dtype (bf16 for a bf16 op: its dots take bf16 operands);
v [B, T, H, V] read from the token layout. Per chunk and head
    o = scale (r_in S_in + A_rb U + A_rk v)
written straight to the token layout [B, T, H, V] in the output dtype: `tok` [S * BT] int64
holds the flat token index (b * T + t) of every slot row, -1 on pad rows. Backward, with
do' = scale do read from the token layout (pad rows 0):
    dr_in = do' S_in^T,  dS_in = r_in^T do',  dA_rb = do' U^T,  dU = A_rb^T do',
    dA_rk = do' v^T,  dv = A_rk^T do'.
Dots on fp32 intermediates are fp32-accurate (tf32x3) unless allow_tf32() is active; a bf16
op's are bf16 dots accumulated in fp32 (do enters as read, the products are scaled after).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_alloc import alloc
from ..triton_scalar_gate import block, fp32_dot_precision
from .dplr_scores import _dot, dot_dtype


@triton.jit
def _dplr_out_fwd(r_in, S_in, A_rb, U, A_rk, v, tok, o, scale, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                PREC: tl.constexpr, DT: tl.constexpr):
    i_s, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    base = i_s.to(tl.int64) * H + i_h
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    rows = base * BT + o_t
    p_a = rows[:, None] * BT + o_t[None, :]
    p_v = rows[:, None] * V + o_v[None, :]
    t = tl.load(tok + i_s.to(tl.int64) * BT + o_t)
    acc = _dot(tl.load(A_rb + p_a), tl.load(U + p_v, mask=m_v[None, :], other=0.), DT, PREC)
    acc += _dot(tl.load(A_rk + p_a), _ld_v(v, t, i_h, o_v, m_v, H, V), DT, PREC)
    for kb in range(tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_r = tl.load(r_in + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
        b_S = tl.load(S_in + (base * K + o_k)[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.)
        acc += _dot(b_r, b_S, DT, PREC)
    tl.store(o + (t * H + i_h)[:, None] * V + o_v[None, :], (acc * scale).to(o.dtype.element_ty),
             mask=(t >= 0)[:, None] & m_v[None, :])


@triton.jit
def _ld_v(x, t, i_h, o_v, m_v, H: tl.constexpr, V: tl.constexpr):
    """Tile [len(t), BV] of x [B, T, H, V] (v or do) in its dtype at flat tokens t (0 where
    t < 0)."""
    return tl.load(x + (t * H + i_h)[:, None] * V + o_v[None, :],
                   mask=(t >= 0)[:, None] & m_v[None, :], other=0.)


@triton.jit
def _dplr_out_bwd(r_in, S_in, A_rb, U, A_rk, v, tok, do, scale, dr_in, dS_in, dA_rb, dU, dA_rk,
                dv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    # do enters every dot as read; the products are scaled afterwards
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    base = i_s.to(tl.int64) * H + i_h
    o_t = tl.arange(0, BT)
    rows = base * BT + o_t
    p_a = rows[:, None] * BT + o_t[None, :]
    t = tl.load(tok + i_s.to(tl.int64) * BT + o_t)
    g_rb = tl.zeros([BT, BT], dtype=tl.float32)
    g_rk = tl.zeros([BT, BT], dtype=tl.float32)
    for vb in range(tl.cdiv(V, BV)):
        o_v = vb * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = rows[:, None] * V + o_v[None, :]
        b_do = _ld_v(do, t, i_h, o_v, m_v, H, V)
        g_rb += _dot(b_do, tl.trans(tl.load(U + p_v, mask=m_v[None, :], other=0.)), DT, PREC)
        g_rk += _dot(b_do, tl.trans(_ld_v(v, t, i_h, o_v, m_v, H, V)), DT, PREC)
    tl.store(dA_rb + p_a, g_rb * scale)
    tl.store(dA_rk + p_a, g_rk * scale)
    for vb in range(tl.cdiv(V, BV)):
        o_v = vb * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = rows[:, None] * V + o_v[None, :]
        b_do = _ld_v(do, t, i_h, o_v, m_v, H, V)
        tl.store(dU + p_v, _dot(tl.trans(tl.load(A_rb + p_a)), b_do, DT, PREC) * scale,
                 mask=m_v[None, :])
        tl.store(dv + p_v, _dot(tl.trans(tl.load(A_rk + p_a)), b_do, DT, PREC) * scale,
                 mask=m_v[None, :])
        for kb in range(tl.cdiv(K, BK)):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_r = tl.load(r_in + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
            tl.store(dS_in + (base * K + o_k)[:, None] * V + o_v[None, :],
                     _dot(tl.trans(b_r), b_do, DT, PREC) * scale,
                     mask=m_k[:, None] & m_v[None, :])
    for kb in range(tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        g_r = tl.zeros([BT, BK], dtype=tl.float32)
        for vb in range(tl.cdiv(V, BV)):
            o_v = vb * BV + tl.arange(0, BV)
            m_v = o_v < V
            b_do = _ld_v(do, t, i_h, o_v, m_v, H, V)
            b_S = tl.load(S_in + (base * K + o_k)[:, None] * V + o_v[None, :],
                          mask=m_k[:, None] & m_v[None, :], other=0.)
            g_r += _dot(b_do, tl.trans(b_S), DT, PREC)
        tl.store(dr_in + rows[:, None] * K + o_k[None, :], g_r * scale, mask=m_k[None, :])


# warps of the forward / backward kernels: H100 bf16 RWKV-7 K64 (session 9 call 3), 8 -> 4:
# fwd -0.13 ms, bwd -0.26 ms
LAUNCH = dict(fwd_warps=4, bwd_warps=4)


def _tiles(K, V):
    return min(block(K), 64), min(block(V), 64)


def output_fwd(r_in, S_in, A_rb, U, A_rk, v, tok, scale, B, T, dtype):
    """Slot layout (contiguous; r_in, S_in, U, A_rb, A_rk in dplr_scores.inter_dtype)
    except v [B, T, H, V] (token layout) -> o [B, T, H, V] in `dtype`."""
    S, H, BT, K = r_in.shape
    V = v.shape[-1]
    BK, BV = _tiles(K, V)
    o = alloc((B, T, H, V), dtype, v.device)
    _dplr_out_fwd[(S, H, triton.cdiv(V, BV))](
        r_in, S_in, A_rb, U, A_rk, v, tok, o, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        PREC=fp32_dot_precision(), DT=dot_dtype(r_in.dtype), num_warps=LAUNCH["fwd_warps"],
        num_stages=1)
    return o


def output_bwd(r_in, S_in, A_rb, U, A_rk, v, tok, scale, do):
    """do [B, T, H, V] contiguous -> (dr_in, dS_in, dA_rb, dU, dA_rk, dv), fp32 slot layout."""
    S, H, BT, K = r_in.shape
    V = v.shape[-1]
    BK, BV = _tiles(K, V)
    dev = v.device
    grads = [alloc(x.shape, torch.float32, dev) for x in (r_in, S_in, A_rb, U, A_rk, U)]
    _dplr_out_bwd[(S, H)](r_in, S_in, A_rb, U, A_rk, v, tok, do, scale, *grads, H=H, K=K, V=V,
                        BT=BT, BK=BK, BV=BV, PREC=fp32_dot_precision(),
                        DT=dot_dtype(r_in.dtype), num_warps=LAUNCH["bwd_warps"], num_stages=1)
    return tuple(grads)
