"""Token-by-token GLA (per-key gate) in Triton: forward and backward behind a
torch.autograd.Function.

Per sequence and head, with a_t = exp(g_t) in R^K and S [K, V] fp32 in registers:
    S_t = diag(a_t) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t
Each key channel c is a scalar-gated recurrence of its own, so the kernels are those of
simple_gla/triton_recurrent.py with the decay taken per key row:
- forward: per (sequence, head, block of V), full K.
- dq: forward order, per (sequence, head, block of K), full V; also the carried part of
  q_t . dq_t per channel and fin = <dS_T, a_T S_{T-1}> per channel.
- dk / dv / dh0: reverse order, per (sequence, head, K block, V block), carrying
  dS_t = diag(a_{t+1}) dS_{t+1} + scale q_t^T do_t; dk, dv and k . dk are partial sums over
  the other block axis (fp32, summed on the host).
- dg[t, c] = reverse cumsum per sequence of q_t[c] dq_t[c] - k_t[c] dk_t[c] without their
  common current-token term scale q_t[c] k_t[c] (v_t . do_t), starting from fin[c]; the last
  token's carried k_T[c] (dS_T v_T)[c] is left out (it and <dS_T, S_T> are O(1) and cancel).
Everything is computed in fp32 (no tensor-core dots): decoding and short sequences.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.engine.launch import block
from ..common.engine.varlen import seq_bounds
from ..common.kernel_alloc import alloc as _alloc
from ..common.triton_gate_grad import sequence_reverse_cumsum
from ..common.triton_seq_layout import seq_offsets

MAX_HEAD_DIM = 256


@triton.jit
def _rec_fwd_kernel(q, k, v, g, h0, o, ht, cu_seqlens, scale, T, H: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, KF: tl.constexpr, BV: tl.constexpr,
                    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr):
    pid = tl.program_id(0)
    NVB: tl.constexpr = (V + BV - 1) // BV
    i_v, i_nh = pid % NVB, pid // NVB
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, KF)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_kv = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    state = tl.zeros([KF, BV], dtype=tl.float32)
    if USE_H0:
        state += tl.load(h0 + p_kv, mask=m_kv, other=0.)
    for t in range(bos, eos):
        row = t * H + i_h
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_g = tl.load(g + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
        state = state * tl.exp(b_g)[:, None] + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(state * b_q[:, None], axis=0) * scale
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + p_kv, state, mask=m_kv)


@triton.jit
def _rec_dq_kernel(q, k, v, g, h0, dht, do, dq, qdq, fin, cu_seqlens, scale, T,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   VF: tl.constexpr, USE_H0: tl.constexpr, STORE_QDQ: tl.constexpr,
                   STORE_FIN: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Forward walk over one block of K rows. The carried state is diag(a_t) S_{t-1} (the
    token's own k_t^T v_t is added at the next token); fin [N*H, K] gets
    <dS_T, diag(a_T) S_{T-1}> per key channel."""
    pid = tl.program_id(0)
    NKB: tl.constexpr = (K + BK - 1) // BK
    i_kb, i_nh = pid % NKB, pid // NKB
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = i_kb * BK + tl.arange(0, BK)
    o_v = tl.arange(0, VF)
    m_k, m_v = o_k < K, o_v < V
    p_kv = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    state = tl.zeros([BK, VF], dtype=tl.float32)
    if USE_H0:
        state += tl.load(h0 + p_kv, mask=m_kv, other=0.)
    k_prev = tl.zeros([BK], dtype=tl.float32)
    v_prev = tl.zeros([VF], dtype=tl.float32)
    for t in range(bos, eos):
        row = t * H + i_h
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_do = tl.load(do + row * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_g = tl.load(g + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
        state = (state + k_prev[:, None] * v_prev[None, :]) * tl.exp(b_g)[:, None]
        # dq_t = scale (diag(a_t) S_{t-1}) do_t + scale k_t (v_t . do_t): the carried part first
        b_dq_in = tl.sum(state * b_do[None, :], axis=1) * scale
        b_dq = b_dq_in + b_k * (scale * tl.sum(b_v * b_do, axis=0))
        tl.store(dq + row * K + o_k, b_dq.to(dq.dtype.element_ty), mask=m_k)
        if STORE_QDQ:
            b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
            tl.store(qdq + row * K + o_k, b_q * b_dq_in, mask=m_k)
        k_prev = b_k
        v_prev = b_v
    if STORE_FIN:
        b_dht = tl.load(dht + p_kv, mask=m_kv, other=0.)
        tl.store(fin + i_nh.to(tl.int64) * K + o_k, tl.sum(b_dht * state, axis=1), mask=m_k)


@triton.jit
def _rec_bwd_kernel(q, k, v, g, dht, do, dkp, dvp, dh0, kdk, cu_seqlens, scale, T,
                    part_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr,
                    STORE_DH0: tl.constexpr, STORE_KDK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Reverse walk over one [BK, BV] block of dS. dkp [NVB, B*T*H*K] and dvp [NKB, B*T*H*V]
    receive partial sums (fp32); kdk [NVB, B*T*H*K] the share of k . dk per channel."""
    pid = tl.program_id(0)
    NKB: tl.constexpr = (K + BK - 1) // BK
    NVB: tl.constexpr = (V + BV - 1) // BV
    i_kb, i_vb, i_nh = pid % NKB, (pid // NKB) % NVB, pid // (NKB * NVB)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = i_kb * BK + tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_kv = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    dstate = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dstate += tl.load(dht + p_kv, mask=m_kv, other=0.)
    for i in range(0, eos - bos):
        t = eos - 1 - i
        row = t * H + i_h
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_do = tl.load(do + row * V + o_v, mask=m_v, other=0.).to(tl.float32)
        # dk_t = (diag(a_{t+1}) dS_{t+1}) v_t + scale q_t (do_t . v_t): the carried part first
        b_dk_in = tl.sum(dstate * b_v[None, :], axis=1)
        dstate += scale * b_q[:, None] * b_do[None, :]
        b_dk = b_dk_in + b_q * (scale * tl.sum(b_do * b_v, axis=0))
        b_dv = tl.sum(dstate * b_k[:, None], axis=0)
        tl.store(dkp + i_vb * part_stride * K + row * K + o_k, b_dk, mask=m_k)
        tl.store(dvp + i_kb * part_stride * V + row * V + o_v, b_dv, mask=m_v)
        if STORE_KDK:
            # without the current-token term; at the last token without the carried part too
            # (dg then starts from fin = <dS_T, diag(a_T) S_{T-1}>, not from <dS_T, S_T>)
            b_kdk = tl.where(i > 0, b_dk_in * b_k, 0.)
            tl.store(kdk + i_vb * part_stride * K + row * K + o_k, b_kdk, mask=m_k)
        b_g = tl.load(g + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
        dstate *= tl.exp(b_g)[:, None]
    if STORE_DH0:
        tl.store(dh0 + p_kv, dstate, mask=m_kv)


def recurrent_fwd(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    """o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32 (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    KF = block(K)
    BV = min(block(V), 32 if KF <= 128 else 16)
    o = _alloc(v.shape, q.dtype, q.device)
    ht = _alloc((N, H, K, V), torch.float32, q.device) if output_final_state else None
    _rec_fwd_kernel[(triton.cdiv(V, BV) * N * H,)](
        q, k, v, g, initial_state if initial_state is not None else q, o,
        ht if ht is not None else o, cu_seqlens if cu_seqlens is not None else q, scale, T,
        H=H, K=K, V=V, KF=KF, BV=BV, USE_H0=initial_state is not None,
        STORE_HT=ht is not None, IS_VARLEN=cu_seqlens is not None, num_warps=4)
    return o, ht


def recurrent_bwd(q, k, v, g, scale, initial_state, cu_seqlens, do, dht, need_dg):
    """(dq, dk, dv in their inputs' dtypes, dg [B, T, H, K] fp32 or None, dh0 fp32 or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dev = q.device
    KF, VF = block(K), block(V)
    cu_arg = cu_seqlens if cu_seqlens is not None else q
    part = B * T * H

    BKq = min(KF, 32 if VF > 128 else 64)
    dq = _alloc(q.shape, q.dtype, dev)
    qdq = _alloc(q.shape, torch.float32, dev) if need_dg else None
    store_fin = need_dg and dht is not None
    fin = _alloc((N, H, K), torch.float32, dev) if store_fin else None
    _rec_dq_kernel[(triton.cdiv(K, BKq) * N * H,)](
        q, k, v, g, initial_state if initial_state is not None else q,
        dht if dht is not None else q, do, dq, qdq if qdq is not None else dq,
        fin if fin is not None else dq, cu_arg, scale, T, H=H, K=K, V=V, BK=BKq, VF=VF,
        USE_H0=initial_state is not None, STORE_QDQ=need_dg, STORE_FIN=store_fin,
        IS_VARLEN=cu_seqlens is not None, num_warps=4)

    BK, BV = min(KF, 64), min(VF, 64)
    NKB, NVB = triton.cdiv(K, BK), triton.cdiv(V, BV)
    dkp = _alloc((NVB,) + tuple(k.shape), torch.float32, dev)
    dvp = _alloc((NKB,) + tuple(v.shape), torch.float32, dev)
    dh0 = _alloc(initial_state.shape, torch.float32, dev) if initial_state is not None else None
    kdk = _alloc((NVB,) + tuple(k.shape), torch.float32, dev) if need_dg else None
    _rec_bwd_kernel[(NKB * NVB * N * H,)](
        q, k, v, g, dht if dht is not None else q, do, dkp, dvp,
        dh0 if dh0 is not None else dkp, kdk if kdk is not None else dkp, cu_arg, scale, T,
        part, H=H, K=K, V=V, BK=BK, BV=BV, USE_DHT=dht is not None,
        STORE_DH0=dh0 is not None, STORE_KDK=need_dg, IS_VARLEN=cu_seqlens is not None,
        num_warps=4)
    dk = dkp.sum(0).to(k.dtype)
    dv = dvp.sum(0).to(v.dtype)
    dg = None
    if need_dg:
        dgt = (qdq - kdk.sum(0)).view(B * T, H * K)
        extra = fin.view(N, H * K) if fin is not None else None
        dg = sequence_reverse_cumsum(dgt, seq_offsets(B, T, cu_seqlens, dev), extra)
        dg = dg.view(B, T, H, K)
    return dq, dk, dv, dg, dh0


class _RecurrentGLA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
        o, ht = recurrent_fwd(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, initial_state, cu_seqlens = ctx.saved_tensors
        dq, dk, dv, dg, dh0 = recurrent_bwd(q, k, v, g, ctx.scale, initial_state, cu_seqlens,
                                            do.contiguous(), _contig(dht),
                                            ctx.needs_input_grad[3])
        return dq, dk, dv, dg, None, dh0, None, None


def _contig(x):
    return None if x is None else x.contiguous()


def fused_recurrent_gla_triton(q, k, v, *, g, scale=1.0, initial_state=None,
                               output_final_state=False, cu_seqlens=None):
    """Token-by-token GLA (Triton). q, k [B, T, H, K]; v [B, T, H, V] (bf16/fp16/fp32);
    g [B, T, H, K] fp32 log-decay; initial_state [N, H, K, V] fp32 or None; cu_seqlens [N+1]
    int or None (B == 1). Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32
    or None). K, V <= 256."""
    for name, size in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if size > MAX_HEAD_DIM:
            raise ValueError(f"fused_recurrent_gla(impl='triton'): head size {name}={size}; "
                             f"expected {name} <= {MAX_HEAD_DIM}")
    return _RecurrentGLA.apply(_contig(q), _contig(k), _contig(v), _contig(g), float(scale),
                               _contig(initial_state), bool(output_final_state), cu_seqlens)
