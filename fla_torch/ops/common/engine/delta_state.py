"""Inter-chunk state pass of the (per-key-gated) delta rule (Triton), forward and backward.

One program per (V block, sequence, head) walks the chunks of its sequence with the whole K
of the state tile [K, BV] fp32 in registers. With w, u from wy.py, kg = k exp(last - b) and
el = exp(last) from gates.chunk_cumsum (b the in-chunk cumsum of the log-decay, `last` its
value at the chunk's end):
    forward:  h[slot] = S (the state before the chunk, in h's dtype)
              vn = u - w S                                   (stored in u's dtype)
              S <- diag(el) S + kg^T vn;   final state = S (fp32)
    backward: dh[slot] = dS (the gradient of the state after the chunk, in dh's dtype)
              dvn = scale Aqk^T do + kg dS                   (stored fp32)
              dS <- diag(el) dS + scale qg^T do - w^T dvn;   dh0 = dS before the first chunk
(Aqk: scores.intra_scores on (q, k); qg = q exp(b), its second output.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import block
from .varlen import chunk_slot, n_slots, seq_bounds

BT = 64
# Launch parameters for 16-bit inputs and K <= 128 (else BV 32, one stage); a tuning script may
# override entries. Three stages keep the next chunks' loads in flight while the state updates
# (the GLA state pass: 0.126 vs 0.225 ms on the H100).
LAUNCH = {"fwd": dict(BV=64, num_warps=4, num_stages=3),
          "bwd": dict(BV=64, num_warps=4, num_stages=2)}


def _tiles(K, V, dtype, which):
    """(BK, BV, launch kwargs): the whole K, a block of V sized for the register tile."""
    BK = block(K)
    wide = BK > 128 or dtype == torch.float32
    cfg = LAUNCH[which]
    BV = min(block(V), 32 if wide else cfg["BV"])
    return BK, BV, dict(num_warps=cfg["num_warps"], num_stages=1 if wide else cfg["num_stages"])


@triton.jit
def _delta_fwd_kernel(kg, w, u, el, e0, h0, h, vn, ht, cu_seqlens, T, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, REL: tl.constexpr, USE_H0: tl.constexpr,
                      STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_vb, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    dt = kg.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_kv = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        state += tl.load(h0 + i_nh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.)
    for i_c in range(tl.cdiv(eos - bos, BT)):
        slot = chunk_slot(i_n, bos, i_c, T, BT, IS_VARLEN)
        tl.store(h + (slot * H + i_h) * K * V + p_kv, state.to(h.dtype.element_ty), mask=m_kv)
        t = bos + i_c * BT + o_t
        m_t = t < eos
        row = t * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(w + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_u = tl.load(u + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        if REL:
            s_w = state * tl.load(e0 + (slot * H + i_h) * K + o_k, mask=m_k, other=0.)[:, None]
        else:
            s_w = state
        b_vn = b_u.to(tl.float32) - tl.dot(b_w, s_w.to(dt), input_precision=PREC)
        b_vn = b_vn.to(dt)
        tl.store(vn + row[:, None] * V + o_v[None, :], b_vn, mask=m_tv)
        b_k = tl.load(kg + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        state *= tl.load(el + (slot * H + i_h) * K + o_k, mask=m_k, other=0.)[:, None]
        state += tl.dot(tl.trans(b_k), b_vn, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_kv, state, mask=m_kv)


@triton.jit
def _delta_bwd_kernel(qg, kg, w, Aqk, el, e0, do, dht, dh, dvn, dh0, cu_seqlens, scale, T,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, REL: tl.constexpr,
                      USE_DHT: tl.constexpr,
                      STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_vb, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    dt = qg.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_kv = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    dstate = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dstate += tl.load(dht + i_nh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.)
    n_chunks = tl.cdiv(eos - bos, BT)
    for i in range(n_chunks):
        i_c = n_chunks - 1 - i
        slot = chunk_slot(i_n, bos, i_c, T, BT, IS_VARLEN)
        tl.store(dh + (slot * H + i_h) * K * V + p_kv, dstate.to(dh.dtype.element_ty),
                 mask=m_kv)
        t = bos + i_c * BT + o_t
        m_t = t < eos
        row = t * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_At = tl.trans(tl.load(Aqk + ((slot * BT + o_t)[:, None] * H + i_h) * BT
                                + o_t[None, :]) * scale).to(dt)
        b_k = tl.load(kg + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_dvn = tl.dot(b_At, b_do, input_precision=PREC) \
            + tl.dot(b_k, dstate.to(dt), input_precision=PREC)
        tl.store(dvn + row[:, None] * V + o_v[None, :], b_dvn, mask=m_tv)
        b_q = tl.load(qg + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_w = tl.load(w + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        dstate *= tl.load(el + (slot * H + i_h) * K + o_k, mask=m_k, other=0.)[:, None]
        if REL:
            f0 = tl.load(e0 + (slot * H + i_h) * K + o_k, mask=m_k, other=0.)[:, None]
            dstate += f0 * (scale * tl.dot(tl.trans(b_q), b_do, input_precision=PREC)
                            - tl.dot(tl.trans(b_w), b_dvn.to(dt), input_precision=PREC))
        else:
            dstate += scale * tl.dot(tl.trans(b_q), b_do, input_precision=PREC)
            dstate -= tl.dot(tl.trans(b_w), b_dvn.to(dt), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + p_kv, dstate, mask=m_kv)


def _dummy(x, fallback):
    return x if x is not None else fallback


def delta_state_fwd(kg, w, u, el, initial_state, output_final_state: bool, cu_seqlens,
                    prec: str, alloc, e0=None):
    """kg [B, T, H, K], w [B, T, H, K], u [B, T, H, V] (one dtype), el [slots, H, K] fp32,
    initial_state [N, H, K, V] fp32 or None. e0 [slots, H, K] fp32 or None: w is stored as
    w exp(-b_0) (delta_scores' rel) and the state rows are scaled by e0 = exp(b_0) for w h. Returns (h [slots, H, K, V] in kg's dtype,
    vn [B, T, H, V] in u's dtype, final state [N, H, K, V] fp32 or None)."""
    B, T, H, K = kg.shape
    V = u.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    BK, BV, kw = _tiles(K, V, kg.dtype, "fwd")
    h = alloc((n_slots(B, T, N, BT, cu_seqlens is not None), H, K, V), kg.dtype)
    vn = alloc(u.shape, u.dtype)
    ht = alloc((N, H, K, V), torch.float32) if output_final_state else None
    _delta_fwd_kernel[(triton.cdiv(V, BV), N * H)](
        kg, w, u, el, _dummy(e0, el), _dummy(initial_state, el), h, vn, _dummy(ht, el),
        _dummy(cu_seqlens, el), T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, REL=e0 is not None,
        USE_H0=initial_state is not None,
        STORE_HT=ht is not None, IS_VARLEN=cu_seqlens is not None, PREC=prec, **kw)
    return h, vn, ht


def delta_state_bwd(qg, kg, w, Aqk, el, do, dht, scale: float, cu_seqlens, need_dh0: bool,
                    prec: str, alloc, e0=None):
    """qg, kg, w [B, T, H, K] (one dtype), Aqk [slots * BT, H, BT] fp32, el [slots, H, K]
    fp32, do [B, T, H, V], dht [N, H, K, V] fp32 or None. e0 [slots, H, K] fp32 or None: qg and
    w relative to the chunk's first row (delta_scores' rel), their products scaled by e0. Returns (dh [slots, H, K, V] in
    qg's dtype, dvn [B, T, H, V] fp32, dh0 [N, H, K, V] fp32 or None)."""
    B, T, H, K = qg.shape
    V = do.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    BK, BV, kw = _tiles(K, V, qg.dtype, "bwd")
    dh = alloc((n_slots(B, T, N, BT, cu_seqlens is not None), H, K, V), qg.dtype)
    dvn = alloc(do.shape, torch.float32)
    dh0 = alloc((N, H, K, V), torch.float32) if need_dh0 else None
    _delta_bwd_kernel[(triton.cdiv(V, BV), N * H)](
        qg, kg, w, Aqk, el, _dummy(e0, el), do, _dummy(dht, el), dh, dvn, _dummy(dh0, el),
        _dummy(cu_seqlens, el), scale, T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        REL=e0 is not None,
        USE_DHT=dht is not None, STORE_DH0=dh0 is not None, IS_VARLEN=cu_seqlens is not None,
        PREC=prec, **kw)
    return dh, dvn, dh0
