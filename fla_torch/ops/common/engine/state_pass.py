"""Inter-chunk state pass (Triton), forward and backward, with the gate switch.

Per (sequence, head, K block, V block) one program walks the chunks of its sequence in order
with the state tile [BK, BV] fp32 in registers. With b the in-chunk cumsum of the log-decay
(gates.chunk_cumsum, read as stored: (hi, lo) per slot row) and `last` its value at the
chunk's end:
    forward:  h[slot] = S (the state before the chunk, stored in h's dtype);
              S <- exp(last) * S + sum_j (k_j * exp(last - b_j))^T v_j
              (k exp(last - b) and exp(last) as stored by gates.chunk_cumsum)
              final state = S after the last chunk (fp32).
    backward: dh[slot] = dS (the gradient of the state after the chunk, in dh's dtype);
              dS <- exp(last) * dS + scale * sum_i (q_i * exp(b_i))^T do_i
              dh0 = dS before the first chunk (fp32).
Key gate: exp(last) is per key row of the state. The decayed 16-bit operands are formed with
every exponent <= 0: k * exp(last - b) as is, q * exp(b - max b) with exp(max b) applied to the
fp32 product (fp16 would underflow q * exp(b) under strong gates).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gates import GATE_NONE, load_cum, load_cum_row, load_decay_last
from .launch import launch_for
from .varlen import cdiv, chunk_slot, n_slots, seq_bounds


@triton.jit
def _state_fwd_kernel(kg, v, el, h0, h, ht, cu_seqlens, T, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      GATE: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
                      IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_kv, i_nh = tl.program_id(0), tl.program_id(1)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_kb, i_vb = i_kv // NV, i_kv % NV
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_kb * BK + tl.arange(0, BK)
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
        b_k = tl.load(kg + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                      other=0.)
        b_v = tl.load(v + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                      other=0.)
        if GATE != GATE_NONE:
            state *= load_decay_last(el, slot, i_h, o_k, m_k, H, K, GATE)[:, None]
        state += tl.dot(tl.trans(b_k), b_v, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_kv, state, mask=m_kv)


@triton.jit
def _state_bwd_kernel(q, do, ch, cl, dht, dh, dh0, cu_seqlens, scale, T, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, GATE: tl.constexpr, USE_DHT: tl.constexpr,
                      STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_kv, i_nh = tl.program_id(0), tl.program_id(1)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_kb, i_vb = i_kv // NV, i_kv % NV
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    dt = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = i_kb * BK + tl.arange(0, BK)
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
        b_q = tl.load(q + row[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                      other=0.)
        b_do = tl.load(do + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                       other=0.)
        if GATE != GATE_NONE:
            srow = slot * BT + o_t
            hi, lo = load_cum(ch, cl, srow, i_h, o_k, m_k, H, K, GATE, BT)
            l_hi, l_lo = load_cum_row(ch, cl, slot * BT + BT - 1, i_h, o_k, m_k, H, K, GATE)
            b_max = tl.max(hi, axis=0)
            b_q = (b_q * tl.exp((hi - b_max[None, :]) + lo)).to(dt)
            dstate *= tl.exp(l_hi + l_lo)[:, None]
            dstate += (scale * tl.exp(b_max))[:, None] * tl.dot(tl.trans(b_q), b_do,
                                                                 input_precision=PREC)
        else:
            dstate += scale * tl.dot(tl.trans(b_q), b_do, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + p_kv, dstate, mask=m_kv)


def _dummy(x, fallback):
    return x if x is not None else fallback


def state_pass_fwd(kg, v, el, gate: int, initial_state, output_final_state: bool, cu_seqlens,
                   h_dtype: torch.dtype, prec: str, alloc):
    """kg = k exp(last - b) [B, T, H, K] and el = exp(last) [slots, H(, K)] fp32 from
    gates.chunk_cumsum (GATE_NONE: k and None), v [B, T, H, V].
    Returns (h [slots, H, K, V] in h_dtype: the state before every chunk,
    final state [N, H, K, V] fp32 or None)."""
    B, T, H, K = kg.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cfg = launch_for("state_fwd", K, V, kg.dtype)
    h = alloc((n_slots(B, T, N, cfg.BT, cu_seqlens is not None), H, K, V), h_dtype)
    ht = alloc((N, H, K, V), torch.float32) if output_final_state else None
    grid = (cdiv(K, cfg.BK) * cdiv(V, cfg.BV), N * H)
    _state_fwd_kernel[grid](
        kg, v, _dummy(el, kg), _dummy(initial_state, kg), h, _dummy(ht, h),
        _dummy(cu_seqlens, kg),
        T, H=H, K=K, V=V, BT=cfg.BT, BK=cfg.BK, BV=cfg.BV, GATE=gate,
        USE_H0=initial_state is not None, STORE_HT=ht is not None,
        IS_VARLEN=cu_seqlens is not None, PREC=prec, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return h, ht


def state_pass_bwd(q, do, cum, gate: int, scale: float, dht, cu_seqlens, need_dh0: bool,
                   h_dtype: torch.dtype, prec: str, alloc):
    """q [B, T, H, K], do [B, T, H, V], cum: the split in-chunk cumsum (hi, lo) from
    gates.chunk_cumsum (None for GATE_NONE), dht [N, H, K, V] fp32 or None.
    Returns (dh [slots, H, K, V] in h_dtype: the gradient of the state after every chunk,
    dh0 [N, H, K, V] fp32 or None)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cfg = launch_for("state_bwd", K, V, q.dtype)
    dh = alloc((n_slots(B, T, N, cfg.BT, cu_seqlens is not None), H, K, V), h_dtype)
    dh0 = alloc((N, H, K, V), torch.float32) if need_dh0 else None
    grid = (cdiv(K, cfg.BK) * cdiv(V, cfg.BV), N * H)
    _state_bwd_kernel[grid](
        q, do, *(cum if cum is not None else (q, q)), _dummy(dht, q), dh, _dummy(dh0, dh),
        _dummy(cu_seqlens, q),
        scale, T, H=H, K=K, V=V, BT=cfg.BT, BK=cfg.BK, BV=cfg.BV, GATE=gate,
        USE_DHT=dht is not None, STORE_DH0=dh0 is not None, IS_VARLEN=cu_seqlens is not None,
        PREC=prec, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dh, dh0
