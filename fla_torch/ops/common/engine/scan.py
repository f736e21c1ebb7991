"""The engine's scalar-gate chunk scan (Triton): state pass and output stage fused in one
sequential kernel per (sequence, head, value block), for GATE_NONE / GATE_SCALAR recurrences
(chunk_simple_gla; the scores and the state update of a scalar gate cost one exp per row, so
nothing is materialised between the stages). Forward and backward kernels, launched by
`scan_fwd` / `scan_bwd`; launch tiles from launch.scan_launch.

Layout: q, k [B, T, H, K], v, o [B, T, H, V] read and written in place (the time axis is
flattened to B*T rows; a sequence is rows [bos, eos) of it, from cu_seqlens or n*T).
Chunks of BT = 64 tokens; per chunk, with b_i the inclusive cumsum of the log-decay
(g + g_gamma, fp32) inside the chunk and S the state before the chunk ([K, V], fp32):

    o_i    = scale * (exp(b_i) q_i S + sum_{j <= i} exp(b_i - b_j) (q_i . k_j) v_j)
    S_next = exp(b_last) S + sum_j exp(b_last - b_j) k_j^T v_j

Every kernel walks the chunks of one sequence in order and keeps its state tile in registers:
- forward: one program per (sequence, head, block of V); full K. Only when g needs a gradient
  does it also write the state before each chunk, h [slots, H, K, V] in q's dtype (for dg;
  slots of varlen.chunk_slot).
- backward (one launch, three kinds of programs, all independent):
    dq: forward order, recomputes S, per (sequence, head, block of K) with full V;
    dk: reverse order, carries dS, per (sequence, head, block of K) with full V;
    dv: reverse order, carries dS, per (sequence, head, block of V) with full K.
  dh0 comes from the dk programs; dg is assembled chunk by chunk (see the note above _bwd_dq)
  from shares written by the dq and dk programs, summed on the host.
Matmul operands are in the input dtype (fp32 ones multiplied fp32-accurately, tf32x3, unless
allow_tf32()); q exp(b) enters the dS update as q exp(b - max b) with exp(max b) applied in
fp32, so strongly decayed rows do not underflow in fp16,
accumulation, decays and states in fp32; the in-chunk cumsum of the log-decay in fp64 (split
into two fp32 parts, see common/triton_scalar_gate.chunk_log_decay).
Tested: Triton 3.9 interpreter (CPU) and Triton 3.6 on an H100.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_alloc import alloc as _alloc
from ..triton_scalar_gate import block, causal_decay, chunk_log_decay, dot_precision
from .launch import scan_launch
from .varlen import chunk_slot, n_slots, seq_bounds

BT = 64


@triton.jit
def _fwd_kernel(q, k, v, g, g_gamma, h0, o, ht, h, cu_seqlens, scale, T,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                USE_GAMMA: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
                STORE_H: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    i_v, i_nh = pid % ((V + BV - 1) // BV), pid // ((V + BV - 1) // BV)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    dt = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    causal = o_t[:, None] >= o_t[None, :]
    gamma = 0.
    if USE_GAMMA:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)

    p_kv = o_k[:, None] * V + o_v[None, :]
    m_state = m_k[:, None] & m_v[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        state += tl.load(h0 + i_nh.to(tl.int64) * K * V + p_kv, mask=m_state, other=0.)

    for i_c in range(tl.cdiv(eos - bos, BT)):
        t = bos + i_c * BT + o_t
        m_t = t < eos
        row = t * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        if STORE_H:
            slot = chunk_slot(i_n, bos, i_c, T, BT, IS_VARLEN)
            tl.store(h + (slot * H + i_h) * K * V + p_kv, state.to(h.dtype.element_ty),
                     mask=m_state)
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        b_o = tl.dot(b_q, state.to(dt), input_precision=PREC)
        if USE_G or USE_GAMMA:
            b, b_lo, to_end, b_last = chunk_log_decay(g, gamma, row, m_t, USE_G, USE_GAMMA, BT)
            b_o *= tl.exp(b)[:, None]
            b_vw = (b_v * tl.exp(to_end)[:, None]).to(dt)
            state *= tl.exp(b_last)
        else:
            b = tl.zeros([BT], dtype=tl.float32)
            b_lo = b
            b_vw = b_v
        A = causal_decay(A, b, b_lo, causal, USE_G or USE_GAMMA)
        b_o += tl.dot(A.to(dt), b_v, input_precision=PREC)
        tl.store(o + row[:, None] * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty),
                 mask=m_tv)
        state += tl.dot(tl.trans(b_k), b_vw, input_precision=PREC)

    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_kv, state, mask=m_state)


# dg. With S_{s-1} the state before token s and dS_s the gradient of the state after it,
# dg_s = exp(g_s) <S_{s-1}, dS_s>. Inside a chunk (b: cumsum of the log-decay from the chunk
# start, S / dS: state before / gradient after the chunk) that is, per token s,
#     exp(b_last) <S, dS>                                            chunk term    (dk programs)
#   + sum_{j < s} exp(b_last - b_j) (k_j dS) . v_j                   = k_j . dk_j^state (dk)
#   + sum_{i >= s} scale exp(b_i) (q_i S) . do_i                     = q_i . dq_i^state (dq)
#   + sum_{j < s <= i} scale exp(b_i - b_j) (q_i . k_j)(do_i . v_j)  intra-chunk       (dq)
# with no carry from chunk to chunk, so nothing cancels over a long sequence. Under gates in
# [-20, -10] every term is decayed except k_L . dk_L (L: the chunk's last token), which the
# exclusive prefix `cumsum(r) - r` formed and cancelled at L (fp32 dg error 1.2e-3): it is
# zeroed first (test_chunk_dg_uniformly_strong_gates_fp32). The other in-chunk sums keep
# cumsum differences: their terms are all decayed, and masked [BT, BT] sums in the
# sequential loop cost 0.25 ms of a 1.3 ms backward on the H100. Each program
# writes its share (a partial sum over its block of K) of dg; the host sums the shares. S per
# chunk comes from the forward (`h`), as the dk programs walk backwards.


@triton.jit
def _bwd_dq(q, k, v, g, gamma, h0, do, dq, dgp, i_kb, i_nh, i_h, bos, eos, scale, part_stride,
            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
            BK: tl.constexpr, VF: tl.constexpr, USE_G: tl.constexpr, USE_GAMMA: tl.constexpr,
            USE_H0: tl.constexpr, STORE_DG: tl.constexpr, PREC: tl.constexpr):
    """dq (and its share of dg) for keys [i_kb*BK, +BK): forward order, recomputing the
    state [BK, V] (full V)."""
    dt = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = i_kb * BK + tl.arange(0, BK)
    o_v = tl.arange(0, VF)
    m_k = o_k < K
    m_v = o_v < V
    causal = o_t[:, None] >= o_t[None, :]
    state = tl.zeros([BK, VF], dtype=tl.float32)
    if USE_H0:
        state += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                         mask=m_k[:, None] & m_v[None, :], other=0.)
    for i_c in range(tl.cdiv(eos - bos, BT)):
        t = bos + i_c * BT + o_t
        m_t = t < eos
        row = t * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        dA = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_dq = tl.dot(b_do, tl.trans(state.to(dt)), input_precision=PREC)
        if USE_G or USE_GAMMA:
            b, b_lo, to_end, b_last = chunk_log_decay(g, gamma, row, m_t, USE_G, USE_GAMMA, BT)
            b_dq *= tl.exp(b)[:, None]
            b_vw = (b_v * tl.exp(to_end)[:, None]).to(dt)
            state *= tl.exp(b_last)
        else:
            b = tl.zeros([BT], dtype=tl.float32)
            b_lo = b
            b_vw = b_v
        dA = causal_decay(dA, b, b_lo, causal, USE_G or USE_GAMMA)
        if STORE_DG:
            b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            p = tl.sum(b_dq * b_q.to(tl.float32), axis=1)
            M = tl.where(o_t[:, None] > o_t[None, :],
                         tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * dA, 0.)
            x = tl.sum(M, axis=0) - tl.sum(M, axis=1)
            share = tl.sum(p, axis=0) - tl.cumsum(p, axis=0) + p + tl.cumsum(x, axis=0) - x
            tl.store(dgp + i_kb * part_stride + row, share * scale, mask=m_t)
        b_dq += tl.dot(dA.to(dt), b_k, input_precision=PREC)
        tl.store(dq + row[:, None] * K + o_k[None, :], (b_dq * scale).to(dq.dtype.element_ty),
                 mask=m_tk)
        state += tl.dot(tl.trans(b_k), b_vw, input_precision=PREC)


@triton.jit
def _bwd_dk(q, k, v, g, gamma, dht, h, do, dk, dh0, dgp, i_kb, i_n, i_nh, i_h, bos, eos, T,
            scale, part_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
            BT: tl.constexpr, BK: tl.constexpr, VF: tl.constexpr, USE_G: tl.constexpr,
            USE_GAMMA: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
            STORE_DG: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """dk, dh0 (and a share of dg) for keys [i_kb*BK, +BK): reverse order, carrying the state
    gradient [BK, V] (full V)."""
    dt = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = i_kb * BK + tl.arange(0, BK)
    o_v = tl.arange(0, VF)
    m_k = o_k < K
    m_v = o_v < V
    causal = o_t[:, None] >= o_t[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    m_state = m_k[:, None] & m_v[None, :]
    dstate = tl.zeros([BK, VF], dtype=tl.float32)
    if USE_DHT:
        dstate += tl.load(dht + i_nh.to(tl.int64) * K * V + p_kv, mask=m_state, other=0.)
    n_chunks = tl.cdiv(eos - bos, BT)
    for i in range(n_chunks):
        i_c = n_chunks - 1 - i
        t = bos + i_c * BT + o_t
        m_t = t < eos
        row = t * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        dA = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_dk = tl.dot(b_v, tl.trans(dstate.to(dt)), input_precision=PREC)
        if USE_G or USE_GAMMA:
            b, b_lo, to_end, b_last = chunk_log_decay(g, gamma, row, m_t, USE_G, USE_GAMMA, BT)
            b_dk *= tl.exp(to_end)[:, None]
            b_max = tl.max(b, axis=0)   # q exp(b - max) in dt, exp(max) in fp32: no fp16
            q_scale = tl.exp(b_max)     # underflow of strongly decayed rows (dh0 error 1e-2)
            b_qw = (b_q * tl.exp(b - b_max)[:, None]).to(dt)
        else:
            b = tl.zeros([BT], dtype=tl.float32)
            b_lo = b
            b_qw = b_q
            q_scale = 1.0
        if STORE_DG:
            slot = chunk_slot(i_n, bos, i_c, T, BT, IS_VARLEN)
            b_h = tl.load(h + (slot * H + i_h) * K * V + p_kv, mask=m_state, other=0.)
            b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            r = tl.sum(b_dk * b_k.to(tl.float32), axis=1)
            chunk_term = tl.exp(b_last) * tl.sum(tl.sum(b_h.to(tl.float32) * dstate, axis=1),
                                                 axis=0)
            # r of the chunk's last valid token (the only undecayed one) is left out of the
            # exclusive prefix sum: cumsum - r would form and cancel it at that token
            r = tl.where(t == tl.minimum(bos + i_c * BT + BT, eos) - 1, 0., r)
            tl.store(dgp + i_kb * part_stride + row, chunk_term + tl.cumsum(r, axis=0) - r,
                     mask=m_t)
        if USE_G or USE_GAMMA:
            dstate *= tl.exp(b_last)
        dA = causal_decay(dA, b, b_lo, causal, USE_G or USE_GAMMA) * scale
        b_dk += tl.dot(tl.trans(dA.to(dt)), b_q, input_precision=PREC)
        tl.store(dk + row[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
        dstate += (scale * q_scale) * tl.dot(tl.trans(b_qw), b_do, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + p_kv, dstate, mask=m_state)


@triton.jit
def _bwd_dv(q, k, g, gamma, dht, do, dv, i_vb, i_nh, i_h, bos, eos, scale,
            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
            KF: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_GAMMA: tl.constexpr,
            USE_DHT: tl.constexpr, PREC: tl.constexpr):
    """dv for values [i_vb*BV, +BV): reverse order, carrying the state gradient [K, BV]."""
    dt = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, KF)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    causal = o_t[:, None] >= o_t[None, :]
    dstate = tl.zeros([KF, BV], dtype=tl.float32)
    if USE_DHT:
        dstate += tl.load(dht + i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                          mask=m_k[:, None] & m_v[None, :], other=0.)
    n_chunks = tl.cdiv(eos - bos, BT)
    for i in range(n_chunks):
        t = bos + (n_chunks - 1 - i) * BT + o_t
        m_t = t < eos
        row = t * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_k = tl.load(k + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        b_dv = tl.dot(b_k, dstate.to(dt), input_precision=PREC)
        if USE_G or USE_GAMMA:
            b, b_lo, to_end, b_last = chunk_log_decay(g, gamma, row, m_t, USE_G, USE_GAMMA, BT)
            b_dv *= tl.exp(to_end)[:, None]
            b_max = tl.max(b, axis=0)   # q exp(b - max) in dt, exp(max) in fp32: no fp16
            q_scale = tl.exp(b_max)     # underflow of strongly decayed rows (dh0 error 1e-2)
            b_qw = (b_q * tl.exp(b - b_max)[:, None]).to(dt)
            dstate *= tl.exp(b_last)
        else:
            b = tl.zeros([BT], dtype=tl.float32)
            b_lo = b
            b_qw = b_q
            q_scale = 1.0
        A = causal_decay(A, b, b_lo, causal, USE_G or USE_GAMMA) * scale
        b_dv += tl.dot(tl.trans(A.to(dt)), b_do, input_precision=PREC)
        tl.store(dv + row[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)
        dstate += (scale * q_scale) * tl.dot(tl.trans(b_qw), b_do, input_precision=PREC)


@triton.jit
def _bwd_kernel(q, k, v, g, g_gamma, h0, dht, h, do, dq, dk, dv, dh0, dgp, cu_seqlens,
                scale, T, part_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KF: tl.constexpr,
                VF: tl.constexpr, NKB: tl.constexpr, USE_G: tl.constexpr,
                USE_GAMMA: tl.constexpr, USE_H0: tl.constexpr, USE_DHT: tl.constexpr,
                STORE_DH0: tl.constexpr, STORE_DG: tl.constexpr, IS_VARLEN: tl.constexpr,
                PREC: tl.constexpr):
    """Programs per (sequence, head): NKB dq blocks, NKB dk blocks, then the dv blocks."""
    pid = tl.program_id(0)
    NR: tl.constexpr = 2 * NKB + (V + BV - 1) // BV
    i_r, i_nh = pid % NR, pid // NR
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    gamma = 0.
    if USE_GAMMA:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)
    if i_r < NKB:
        _bwd_dq(q, k, v, g, gamma, h0, do, dq, dgp, i_r, i_nh, i_h, bos, eos, scale,
                part_stride, H, K, V, BT, BK, VF, USE_G, USE_GAMMA, USE_H0, STORE_DG, PREC)
    elif i_r < 2 * NKB:
        _bwd_dk(q, k, v, g, gamma, dht, h, do, dk, dh0, dgp + NKB * part_stride, i_r - NKB, i_n,
                i_nh, i_h, bos, eos, T, scale, part_stride, H, K, V, BT, BK, VF, USE_G,
                USE_GAMMA, USE_DHT, STORE_DH0, STORE_DG, IS_VARLEN, PREC)
    else:
        _bwd_dv(q, k, g, gamma, dht, do, dv, i_r - 2 * NKB, i_nh, i_h, bos, eos, scale,
                H, K, V, BT, KF, BV, USE_G, USE_GAMMA, USE_DHT, PREC)


# Launch configurations: fixed rules, no autotuning (first call = compile only). Measured on an
def scan_fwd(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens,
             store_states: bool = False):
    """o [B, T, H, V] (q's dtype), final state [N, H, K, V] fp32 or None, and with
    store_states the state before every chunk, h [slots, H, K, V] in q's dtype (else None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cfg = scan_launch("fwd", K, V, N * H, q.element_size())
    BV = cfg.BV
    o = _alloc(v.shape, q.dtype, q.device)
    ht = _alloc((N, H, K, V), torch.float32, q.device) if output_final_state else None
    h = None
    if store_states:
        h = _alloc((n_slots(B, T, N, BT, cu_seqlens is not None), H, K, V), q.dtype, q.device)
    _fwd_kernel[(triton.cdiv(V, BV) * N * H,)](
        q, k, v, g if g is not None else q, g_gamma if g_gamma is not None else q,
        initial_state if initial_state is not None else q, o, ht if ht is not None else o,
        h if h is not None else o, cu_seqlens if cu_seqlens is not None else q, scale, T,
        H=H, K=K, V=V, BT=BT, BK=block(K), BV=BV, USE_G=g is not None,
        USE_GAMMA=g_gamma is not None, USE_H0=initial_state is not None,
        STORE_HT=ht is not None, STORE_H=h is not None, IS_VARLEN=cu_seqlens is not None,
        PREC=dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o, ht, h


def scan_bwd(q, k, v, g, g_gamma, scale, initial_state, cu_seqlens, do, dht, h):
    """(dq, dk, dv in their inputs' dtypes, dg [B, T, H] fp32 or None, dh0 fp32 or None).
    dg is computed when `h` (the forward's per-chunk states) is given."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cfg = scan_launch("bwd", K, V, N * H, q.element_size())
    BK, BV = cfg.BK, cfg.BV
    NKB, NVB = triton.cdiv(K, BK), triton.cdiv(V, BV)
    dq = _alloc(q.shape, q.dtype, q.device)
    dk = _alloc(k.shape, k.dtype, k.device)
    dv = _alloc(v.shape, v.dtype, v.device)
    dh0 = None
    if initial_state is not None:
        dh0 = _alloc(initial_state.shape, torch.float32, q.device)
    store_dg = g is not None and h is not None
    dgp = _alloc((2 * NKB, B * T, H), torch.float32, q.device) if store_dg else None
    _bwd_kernel[((2 * NKB + NVB) * N * H,)](
        q, k, v, g if g is not None else q, g_gamma if g_gamma is not None else q,
        initial_state if initial_state is not None else q, dht if dht is not None else q,
        h if h is not None else q, do, dq, dk, dv, dh0 if dh0 is not None else dq,
        dgp if dgp is not None else dq, cu_seqlens if cu_seqlens is not None else q,
        scale, T, B * T * H, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, KF=block(K), VF=block(V),
        NKB=NKB, USE_G=g is not None, USE_GAMMA=g_gamma is not None,
        USE_H0=initial_state is not None, USE_DHT=dht is not None,
        STORE_DH0=dh0 is not None, STORE_DG=store_dg, IS_VARLEN=cu_seqlens is not None,
        PREC=dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    dg = dgp.sum(0).view(B, T, H) if store_dg else None
    return dq, dk, dv, dg, dh0
