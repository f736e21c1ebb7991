"""Output stage (Triton), forward, chunk-parallel, with the gate switch.

Inputs besides q, k, v ([B, T, H, K|V]): the split in-chunk cumsum b of the log-decay
(gates.chunk_cumsum), the intra-chunk scores A (scores.intra_scores), h[slot] (the state before
the chunk) and dh[slot] (the gradient of the state after it). `last` is b at the chunk's end.
    o_i  = scale * ((q_i * exp(b_i)) S + sum_{j <= i} A_ij v_j)         (one program per
           (chunk slot, head, V block), the whole K in two dots; q exp(b) as stored by
           intra_scores, k exp(last - b) as stored by chunk_cumsum)
The backward is in output_grads.py (it reads A and the split cumsum).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .launch import launch_for
from .varlen import cdiv, n_slots, search_steps, slot_chunk


@triton.jit
def _output_fwd_kernel(qg, v, h, A, o, cu_seqlens, scale, T, N, n_steps, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    slot, i_hv = tl.program_id(0), tl.program_id(1)
    i_h, i_vb = i_hv % H, i_hv // H
    i_n, c0, eos = slot_chunk(cu_seqlens, slot, N, n_steps, T, BT, IS_VARLEN)
    dt = qg.dtype.element_ty
    NK: tl.constexpr = (K + BK - 1) // BK
    o_t = tl.arange(0, BT)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_v = o_v < V
    t_f = c0 + o_t
    m_f = t_f < eos
    s_f = slot.to(tl.int64) * BT + o_t
    p_h = h + (slot.to(tl.int64) * H + i_h) * K * V
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for kb in range(NK):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(qg + (t_f[:, None] * H + i_h) * K + o_k[None, :],
                      mask=m_f[:, None] & m_k[None, :], other=0.)
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                      other=0.)
        acc += tl.dot(b_q, b_h, input_precision=PREC)
    b_A = tl.load(A + (s_f[:, None] * H + i_h) * BT + o_t[None, :])
    b_v = tl.load(v + (t_f[:, None] * H + i_h) * V + o_v[None, :],
                  mask=m_f[:, None] & m_v[None, :], other=0.)
    acc += tl.dot(b_A.to(dt), b_v, input_precision=PREC)
    tl.store(o + (t_f[:, None] * H + i_h) * V + o_v[None, :], (acc * scale).to(o.dtype.element_ty),
             mask=m_f[:, None] & m_v[None, :])


def _grid_args(q, cu_seqlens, BT):
    B, T = q.shape[0], q.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = n_slots(B, T, N, BT, cu_seqlens is not None)
    return S, dict(T=T, N=N, n_steps=search_steps(N))


def _cum_args(cum, x):
    return cum if cum is not None else (x, x)


def output_fwd(qg, v, h, A, scale: float, cu_seqlens, prec: str, alloc):
    """o [B, T, H, V] in qg's dtype from qg = q exp(b) [B, T, H, K] and A [slots * BT, H, BT]
    fp32 or in qg's dtype (scores.intra_scores, cumsum_scores.cumsum_scores), v [B, T, H, V]
    and h [slots, H, K, V] (the state before each chunk, from state_pass_fwd)."""
    H, K, V = qg.shape[2], qg.shape[3], v.shape[3]
    cfg = launch_for("output_fwd", K, V, qg.dtype)
    S, a = _grid_args(qg, cu_seqlens, cfg.BT)
    o = alloc(v.shape, qg.dtype)
    _output_fwd_kernel[(S, H * cdiv(V, cfg.BV))](
        qg, v, h, A, o, cu_seqlens if cu_seqlens is not None else qg, scale, a["T"], a["N"],
        a["n_steps"], H=H, K=K, V=V, BT=cfg.BT, BK=cfg.BK, BV=cfg.BV,
        IS_VARLEN=cu_seqlens is not None, PREC=prec, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return o
