"""Inter-chunk state pass of a DPLR recurrence (Triton), forward and backward.

Slot layout [S, H, BT, D] (dplr.py; u, w, b_out, k_out, U, S_in in dplr_scores.inter_dtype,
bf16 for a bf16 op, whose dots then take bf16 operands; gradients fp32). Per sequence n, its
chunks are the slots first[n] .. first[n] + count[n] - 1. One program per (sequence, head,
V block) carries the state S [K, BV] fp32 (the whole K) through them:
    S_in[slot] = S;   U = u + w S;   S <- diag(tot) S + b_out^T U + k_out^T v
(u, w: the chunk's solved WY terms; b_out, k_out, tot from dplr_scores.py). Backward, dS the
gradient of the state after the chunk (dht at the end):
    dU = dU_ext + b_out dS;   du = dU;   dv = k_out dS;   dw = dU S_in^T;
    db_out = U dS^T;   dk_out = v dS^T;   dtot = rowsum(S_in * dS);
    dS <- diag(tot) dS + w^T dU + dS_in_ext[slot];   dh0 = dS before the first chunk.
The kernel carries dS and stores it per chunk (dh) with dU; dw, db_out, dk_out, dv, dtot are
chunk-parallel products of dh (dplr_tail.py). Slots of no chunk (varlen gaps) hold zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_alloc import alloc
from ..triton_scalar_gate import block, fp32_dot_precision
from .dplr_scores import _dot, _ldx, dot_dtype


@triton.jit
def _dplr_state_fwd(u, w, bout, kout, v, tok, tot, h0, U, S_in, ht, first, count,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                STORE_HT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_kv = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += tl.load(h0 + i_nh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.)
    s0 = tl.load(first + i_n).to(tl.int64)
    nc = tl.load(count + i_n)
    for c in range(nc):
        base = (s0 + c) * H + i_h
        tl.store(S_in + base * K * V + p_kv, S.to(S_in.dtype.element_ty), mask=m_kv)
        rows = base * BT + o_t
        p_k = rows[:, None] * K + o_k[None, :]
        p_v = rows[:, None] * V + o_v[None, :]
        b_w = tl.load(w + p_k, mask=m_k[None, :], other=0.)
        b_U = tl.load(u + p_v, mask=m_v[None, :], other=0.).to(tl.float32) + _dot(b_w, S, DT,
                                                                                     PREC)
        tl.store(U + p_v, b_U.to(U.dtype.element_ty), mask=m_v[None, :])
        b_b = tl.load(bout + p_k, mask=m_k[None, :], other=0.)
        b_t = tl.load(tot + base * K + o_k, mask=m_k, other=0.)
        b_k = tl.load(kout + p_k, mask=m_k[None, :], other=0.)
        b_v = _ldx(v, tl.load(tok + (s0 + c) * BT + o_t), i_h, o_v, m_v, H, V)
        S = b_t[:, None] * S + _dot(tl.trans(b_b), b_U, DT, PREC) + _dot(tl.trans(b_k), b_v,
                                                                          DT, PREC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_kv, S, mask=m_kv)


@triton.jit
def _dplr_state_bwd(w, bout, tot, dU, dS_in, dht, du, dh, dh0, first, count, H: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                PREC: tl.constexpr, DT: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_kv = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS += tl.load(dht + i_nh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.)
    s0 = tl.load(first + i_n).to(tl.int64)
    nc = tl.load(count + i_n)
    for i in range(nc):
        base = (s0 + nc - 1 - i) * H + i_h
        tl.store(dh + base * K * V + p_kv, dS, mask=m_kv)
        rows = base * BT + o_t
        p_k = rows[:, None] * K + o_k[None, :]
        p_v = rows[:, None] * V + o_v[None, :]
        b_b = tl.load(bout + p_k, mask=m_k[None, :], other=0.)
        b_dU = tl.load(dU + p_v, mask=m_v[None, :], other=0.) + _dot(b_b, dS, DT, PREC)
        tl.store(du + p_v, b_dU, mask=m_v[None, :])
        b_w = tl.load(w + p_k, mask=m_k[None, :], other=0.)
        b_t = tl.load(tot + base * K + o_k, mask=m_k, other=0.)
        dS = (b_t[:, None] * dS + _dot(tl.trans(b_w), b_dU, DT, PREC)
              + tl.load(dS_in + base * K * V + p_kv, mask=m_kv, other=0.))
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + p_kv, dS, mask=m_kv)


STAGES = 1     # software-pipelining stages of the two kernels' chunk loops


def _tiles(K, V):
    """(BK: the whole K, BV). An offline sm_90a compile (4 warps, fp32 tf32x3 dots) spills
    0 bytes at K = 64 / BV = 32, 312 at K = 128 / BV = 32 (1408 with BV = 64), 1112 at
    K = 256 / BV = 16."""
    BK = block(K)
    BV = min(block(V), 16 if BK > 128 else 32)
    return BK, BV


def state_fwd(u, w, bout, kout, v, tok, tot, h0, first, count, output_final_state, varlen):
    """v [B, T, H, V] in the token layout (tok: dplr.py's slot-row map), the rest in the slot
    layout. Returns (U [S, H, BT, V], S_in [S, H, K, V] in w's dtype (bf16 for a bf16 op:
    the state is carried in fp32, rounded where stored), final state [N, H, K, V] fp32 or
    None); slots of no chunk (varlen gaps) hold zeros."""
    S, H, BT, V = u.shape
    K = w.shape[-1]
    N = first.shape[0]
    dev = u.device
    BK, BV = _tiles(K, V)
    make = torch.zeros if varlen else (lambda shape, dtype, device: alloc(shape, dtype, device))
    U = make((S, H, BT, V), dtype=w.dtype, device=dev)
    S_in = make((S, H, K, V), dtype=w.dtype, device=dev)
    ht = alloc((N, H, K, V), torch.float32, dev) if output_final_state else None
    _dplr_state_fwd[(triton.cdiv(V, BV), N * H)](
        u, w, bout, kout, v, tok, tot, h0 if h0 is not None else u, U, S_in,
        ht if ht is not None else U, first, count, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        USE_H0=h0 is not None, STORE_HT=ht is not None, PREC=fp32_dot_precision(),
        DT=dot_dtype(w.dtype), num_warps=4, num_stages=STAGES)
    return U, S_in, ht


def state_bwd(w, bout, tot, dU, dS_in, dht, first, count, has_h0, varlen):
    """(du [S, H, BT, V]: the gradient of the solved u (= of U), dh [S, H, K, V]: the gradient
    of the state after each chunk, dh0 [N, H, K, V] or None), fp32."""
    S, H, BT, V = dU.shape
    K = w.shape[-1]
    N = first.shape[0]
    dev = dU.device
    BK, BV = _tiles(K, V)
    make = torch.zeros if varlen else (lambda shape, dtype, device: alloc(shape, dtype, device))
    du = make((S, H, BT, V), dtype=torch.float32, device=dev)
    dh = make((S, H, K, V), dtype=torch.float32, device=dev)
    dh0 = alloc((N, H, K, V), torch.float32, dev) if has_h0 else None
    _dplr_state_bwd[(triton.cdiv(V, BV), N * H)](
        w, bout, tot, dU, dS_in, dht if dht is not None else dU, du, dh,
        dh0 if dh0 is not None else du, first, count, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        USE_DHT=dht is not None, STORE_DH0=dh0 is not None, PREC=fp32_dot_precision(),
        DT=dot_dtype(w.dtype), num_warps=4, num_stages=STAGES)
    return du, dh, dh0
