"""Token-by-token simple GLA in Triton: forward and backward behind a torch.autograd.Function.

Per sequence and head, with a_t = exp(g_t + g_gamma) and S [K, V] fp32 in registers:
    S_t = a_t S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t
Kernels (all walk the tokens of one sequence in order, reading [B, T, H, D] in place):
- forward: per (sequence, head, block of V), full K; writes o and the final state.
- dq: forward order, per (sequence, head, block of K), full V: dq_t = scale * S_t do_t^T,
  the carried part of q_t . dq_t, and fin (below).
- dk / dv / dh0: reverse order, per (sequence, head, block of K, block of V), carrying
  dS_t = a_{t+1} dS_{t+1} + scale q_t^T do_t; dk_t = dS_t v_t^T and dv_t = k_t dS_t are partial
  sums over the other block axis (fp32, summed on the host).
- dg: per token r_t = q_t . dq_t - k_t . dk_t, reverse-cumsummed per sequence
  (common/triton_gate_grad.py). Both dots hold the same current-token term
  scale (q_t . k_t)(v_t . do_t), which cancels; under strong decay the rest is O(a_t), so the
  kernels form r_t without it: q_t . (scale a_t S_{t-1} do_t) - k_t . (a_{t+1} dS_{t+1} v_t)
  (block partial sums of the omitted term are equal on both sides, so dropping is exact).
  The cumsum starts from fin = <dS_T, a_T S_{T-1}> (the dq kernel's carried state after its
  loop) and the last token's k_T . (dS_T v_T) is left out: <dS_T, S_T> is O(1) and cancels
  against that term.
Everything is computed in fp32 (elementwise products, no tensor-core dots); suits decoding and
short sequences; chunk_simple_gla is the fast path for long ones.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.triton_gate_grad import sequence_reverse_cumsum
from ..common.engine.varlen import seq_bounds
from ..common.kernel_alloc import alloc as _alloc
from ..common.triton_scalar_gate import block
from ..common.triton_seq_layout import seq_offsets

MAX_HEAD_DIM = 256


@triton.jit
def _rec_fwd_kernel(q, k, v, g, g_gamma, h0, o, ht, cu_seqlens, scale, T,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KF: tl.constexpr,
                    BV: tl.constexpr, USE_G: tl.constexpr, USE_GAMMA: tl.constexpr,
                    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr):
    pid = tl.program_id(0)
    NVB: tl.constexpr = (V + BV - 1) // BV
    i_v, i_nh = pid % NVB, pid // NVB
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, KF)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    gamma = 0.
    if USE_GAMMA:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)
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
        if USE_G or USE_GAMMA:
            if USE_G:
                state *= tl.exp(tl.load(g + row).to(tl.float32) + gamma)
            else:
                state *= tl.exp(gamma)
        state += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(state * b_q[:, None], axis=0) * scale
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + p_kv, state, mask=m_kv)


@triton.jit
def _rec_dq_kernel(q, k, v, g, g_gamma, h0, dht, do, dq, qdq, fin, cu_seqlens, scale, T,
                   part_stride, fin_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, VF: tl.constexpr, USE_G: tl.constexpr,
                   USE_GAMMA: tl.constexpr, USE_H0: tl.constexpr, STORE_QDQ: tl.constexpr,
                   STORE_FIN: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Forward walk over one block of K rows. The carried state is a_t S_{t-1} (the token's
    own k_t^T v_t is added at the next token), so after the loop it is a_T S_{T-1}; fin
    [NKB, N*H] receives the share of <dS_T, a_T S_{T-1}>."""
    pid = tl.program_id(0)
    NKB: tl.constexpr = (K + BK - 1) // BK
    i_kb, i_nh = pid % NKB, pid // NKB
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = i_kb * BK + tl.arange(0, BK)
    o_v = tl.arange(0, VF)
    m_k = o_k < K
    m_v = o_v < V
    gamma = 0.
    if USE_GAMMA:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)
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
        state += k_prev[:, None] * v_prev[None, :]
        if USE_G or USE_GAMMA:
            if USE_G:
                state *= tl.exp(tl.load(g + row).to(tl.float32) + gamma)
            else:
                state *= tl.exp(gamma)
        # dq_t = scale (a_t S_{t-1}) do_t + scale k_t (v_t . do_t): the carried part first
        b_dq_in = tl.sum(state * b_do[None, :], axis=1) * scale
        b_dq = b_dq_in + b_k * (scale * tl.sum(b_v * b_do, axis=0))
        tl.store(dq + row * K + o_k, b_dq.to(dq.dtype.element_ty), mask=m_k)
        if STORE_QDQ:
            # q . dq without its current-token term scale (q.k)(v.do), which k . dk also
            # carries and which cancels in dg: only the carried part q . b_dq_in is kept
            b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.).to(tl.float32)
            tl.store(qdq + i_kb * part_stride + row, tl.sum(b_q * b_dq_in, axis=0))
        k_prev = b_k
        v_prev = b_v
    if STORE_FIN:
        b_dht = tl.load(dht + p_kv, mask=m_kv, other=0.)
        tl.store(fin + i_kb * fin_stride + i_nh, tl.sum(tl.sum(b_dht * state, axis=1), axis=0))


@triton.jit
def _rec_bwd_kernel(q, k, v, g, g_gamma, dht, do, dkp, dvp, dh0, kdk, cu_seqlens, scale, T,
                    part_stride, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                    USE_GAMMA: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                    STORE_KDK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Reverse walk over one [BK, BV] block of dS. dkp [NVB, B*T*H*K] and dvp
    [NKB, B*T*H*V] receive partial sums (fp32); kdk [NKB*NVB, B*T*H] the share of k . dk."""
    pid = tl.program_id(0)
    NKB: tl.constexpr = (K + BK - 1) // BK
    NVB: tl.constexpr = (V + BV - 1) // BV
    i_kb, i_vb, i_nh = pid % NKB, (pid // NKB) % NVB, pid // (NKB * NVB)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = i_kb * BK + tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    gamma = 0.
    if USE_GAMMA:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)
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
        # dk_t = (a_{t+1} dS_{t+1}) v_t + scale q_t (do_t . v_t): the carried part first
        b_dk_in = tl.sum(dstate * b_v[None, :], axis=1)
        dstate += scale * b_q[:, None] * b_do[None, :]
        b_dk = b_dk_in + b_q * (scale * tl.sum(b_do * b_v, axis=0))
        b_dv = tl.sum(dstate * b_k[:, None], axis=0)
        tl.store(dkp + i_vb * part_stride * K + row * K + o_k, b_dk, mask=m_k)
        tl.store(dvp + i_kb * part_stride * V + row * V + o_v, b_dv, mask=m_v)
        if STORE_KDK:
            # k . dk without the current-token term (see the dq kernel); at the last token the
            # carried part k_T dS_T v_T is left out too: with it, dg starts from <dS_T, S_T>,
            # O(1) and cancelled by it; without it from fin = <dS_T, a_T S_{T-1}>
            b_kdk = tl.sum(b_dk_in * b_k, axis=0)
            tl.store(kdk + (i_vb * NKB + i_kb) * part_stride + row, tl.where(i > 0, b_kdk, 0.))
        if USE_G or USE_GAMMA:
            if USE_G:
                dstate *= tl.exp(tl.load(g + row).to(tl.float32) + gamma)
            else:
                dstate *= tl.exp(gamma)
    if STORE_DH0:
        tl.store(dh0 + p_kv, dstate, mask=m_kv)


def _check(q: torch.Tensor, v: torch.Tensor) -> None:
    for name, size in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if size > MAX_HEAD_DIM:
            raise ValueError(f"fused_recurrent_simple_gla(impl='triton'): head size "
                             f"{name}={size}; expected {name} <= {MAX_HEAD_DIM}")


def recurrent_fwd(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens):
    """o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32 (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    KF = block(K)
    BV = min(block(V), 32 if KF <= 128 else 16)
    o = _alloc(v.shape, q.dtype, q.device)
    ht = _alloc((N, H, K, V), torch.float32, q.device) if output_final_state else None
    _rec_fwd_kernel[(triton.cdiv(V, BV) * N * H,)](
        q, k, v, g if g is not None else q, g_gamma if g_gamma is not None else q,
        initial_state if initial_state is not None else q, o, ht if ht is not None else o,
        cu_seqlens if cu_seqlens is not None else q, scale, T, H=H, K=K, V=V, KF=KF, BV=BV,
        USE_G=g is not None, USE_GAMMA=g_gamma is not None, USE_H0=initial_state is not None,
        STORE_HT=ht is not None, IS_VARLEN=cu_seqlens is not None, num_warps=4)
    return o, ht


def recurrent_bwd(q, k, v, g, g_gamma, scale, initial_state, cu_seqlens, do, dht, ht,
                  need_dg):
    """(dq, dk, dv in their inputs' dtypes, dg [B, T, H] fp32 or None, dh0 fp32 or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dev = q.device
    KF, VF = block(K), block(V)
    common = dict(H=H, K=K, V=V, USE_G=g is not None, USE_GAMMA=g_gamma is not None,
                  IS_VARLEN=cu_seqlens is not None)
    g_arg = g if g is not None else q
    gamma_arg = g_gamma if g_gamma is not None else q
    cu_arg = cu_seqlens if cu_seqlens is not None else q
    part = B * T * H

    BKq = min(KF, 32 if VF > 128 else 64)
    NKq = triton.cdiv(K, BKq)
    dq = _alloc(q.shape, q.dtype, dev)
    qdq = _alloc((NKq, B * T, H), torch.float32, dev) if need_dg else None
    store_fin = need_dg and dht is not None
    fin_part = _alloc((NKq, N * H), torch.float32, dev) if store_fin else None
    _rec_dq_kernel[(NKq * N * H,)](
        q, k, v, g_arg, gamma_arg, initial_state if initial_state is not None else q,
        dht if dht is not None else q, do, dq, qdq if qdq is not None else dq,
        fin_part if fin_part is not None else dq, cu_arg, scale, T, part, N * H, BK=BKq,
        VF=VF, USE_H0=initial_state is not None, STORE_QDQ=need_dg, STORE_FIN=store_fin, **common,
        num_warps=4)

    BK, BV = min(KF, 64), min(VF, 64)
    NKB, NVB = triton.cdiv(K, BK), triton.cdiv(V, BV)
    dkp = _alloc((NVB,) + tuple(k.shape), torch.float32, dev)
    dvp = _alloc((NKB,) + tuple(v.shape), torch.float32, dev)
    dh0 = _alloc(initial_state.shape, torch.float32, dev) if initial_state is not None else None
    kdk = _alloc((NKB * NVB, B * T, H), torch.float32, dev) if need_dg else None
    _rec_bwd_kernel[(NKB * NVB * N * H,)](
        q, k, v, g_arg, gamma_arg, dht if dht is not None else q, do, dkp, dvp,
        dh0 if dh0 is not None else dkp, kdk if kdk is not None else dkp, cu_arg, scale, T,
        part, BK=BK, BV=BV, USE_DHT=dht is not None, STORE_DH0=dh0 is not None,
        STORE_KDK=need_dg, **common, num_warps=4)
    dk = dkp.sum(0).to(k.dtype)
    dv = dvp.sum(0).to(v.dtype)
    dg = None
    if need_dg:
        # r_t = q_t.dq_t - k_t.dk_t less their common current-token term (partials over K/V
        # blocks); dg = its reverse cumsum per sequence plus fin = <dS_T, a_T S_{T-1}>.
        fin = fin_part.sum(0).view(N, H) if fin_part is not None else None
        dgt = qdq.sum(0) - kdk.sum(0)
        dg = sequence_reverse_cumsum(dgt, seq_offsets(B, T, cu_seqlens, dev), fin)
        dg = dg.view(B, T, H)
    return dq, dk, dv, dg, dh0


class _RecurrentSimpleGLA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens):
        o, ht = recurrent_fwd(q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                              cu_seqlens)
        ctx.save_for_backward(q, k, v, g, g_gamma, initial_state, cu_seqlens, ht)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, g_gamma, initial_state, cu_seqlens, ht = ctx.saved_tensors
        need_dg = g is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dg, dh0 = recurrent_bwd(q, k, v, g, g_gamma, ctx.scale, initial_state,
                                            cu_seqlens, do.contiguous(), _contig(dht), ht,
                                            need_dg)
        return dq, dk, dv, dg, None, None, dh0, None, None


def _contig(x):
    return None if x is None else x.contiguous()


def fused_recurrent_simple_gla_triton(q, k, v, *, g=None, g_gamma=None, scale=1.0,
                                      initial_state=None, output_final_state=False,
                                      cu_seqlens=None):
    """Token-by-token simple GLA (Triton). q, k [B, T, H, K]; v [B, T, H, V] (bf16/fp16/fp32);
    g [B, T, H] fp32 or None; g_gamma [H] fp32 or None; initial_state [N, H, K, V] fp32 or
    None; cu_seqlens [N+1] int or None (B == 1). Returns (o [B, T, H, V] in q's dtype,
    final_state [N, H, K, V] fp32 or None). K, V <= 256."""
    _check(q, v)
    return _RecurrentSimpleGLA.apply(_contig(q), _contig(k), _contig(v), _contig(g),
                                     _contig(g_gamma), float(scale), _contig(initial_state),
                                     bool(output_final_state), cu_seqlens)
